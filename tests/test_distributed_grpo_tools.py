"""GRPO tool calling with two CPU processes (gloo) under DDP and DeepSpeed ZeRO-3.

Generation is collective under ZeRO-3 (the parameters are gathered for it), so both ranks must run the same number
of tool-loop turns even when only one of them has rows that called a tool; the idle rank takes part with a
throw-away row. One prompt makes the (scripted) model call the tool twice before answering, the other answers at
once; the two groups land on different ranks. Helpers: tests/distributed_utils.py, tests/test_grpo_tools.py.
"""

import json
from pathlib import Path

import pytest
from distributed_utils import engine_params, launch


pytestmark = pytest.mark.distributed


def train_with_tools(out_dir: str) -> None:
    """Worker: two GRPO steps with a `multiply` tool; writes this rank's tool calls, completions and logs."""
    from test_grpo_tools import ScriptedReplies, chat_dataset, make_multiply, tool_call

    from trl import GRPOConfig, GRPOTrainer
    from trl.assets import get_model_path

    calls, seen = [], []

    def reply(text, turn):
        if "twice" in text and turn < 2:
            return tool_call("multiply", a=3, b=4)
        return "Done."

    def reward(completions: list, **kwargs) -> list[float]:
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        max_steps=2,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=128,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        disable_tqdm=True,
        shuffle_dataset=False,
        seed=0,
    )
    trainer = GRPOTrainer(
        get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=reward,
        args=args,
        train_dataset=chat_dataset("Call the tool twice.", "Answer directly."),
        tools=[make_multiply(calls)],
    )
    ScriptedReplies(trainer, reply)
    trainer.train()
    rank = trainer.accelerator.process_index
    logs = [log for log in trainer.state.log_history if "loss" in log]
    report = {
        "rank": rank,
        "calls": calls,
        "roles": [[m["role"] for m in c] for c in seen],
        "logs": [{k: v for k, v in log.items() if k.startswith("tools/")} for log in logs],
        "distributed_type": str(trainer.accelerator.distributed_type),
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize("engine", engine_params(["ddp", "zero3"]))
def test_tool_loop_keeps_ranks_in_step(engine, tmp_path):
    reports = launch(f"{__file__}:train_with_tools", tmp_path, engine, timeout=400)
    assert {r["rank"] for r in reports} == {0, 1}
    # Per step: one rank has the "twice" group (2 rows x 2 calls), the other one none.
    assert sorted(len(r["calls"]) for r in reports) == [0, 8]
    by_calls = {len(r["calls"]) > 0: r for r in reports}
    assert by_calls[True]["roles"] == [["assistant", "tool", "assistant", "tool", "assistant"]] * 4
    assert by_calls[False]["roles"] == [["assistant"]] * 4
    for report in reports:  # global metrics: 4 calls for 4 completions per step
        assert report["logs"] == [{"tools/call_frequency": 1.0, "tools/failure_frequency": 0.0}] * 2

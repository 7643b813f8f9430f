"""GRPOTrainer tool calling (`tools=`) and environments (`environment_factory=`).

A random tiny model never writes a tool call by itself, so `ScriptedReplies` adds a large bias to the logits during
generation (a forward hook on the model) that makes it write a scripted reply for each assistant turn, chosen from the
conversation so far. Everything else is the real trainer: the tool loop, the response parser, tool execution, the
glue tokens between turns, the loss mask, the rewards and the metrics.
"""

import json
import logging
import re

import pytest
import torch
from datasets import Dataset
from trainer_utils import GROUP_ARGS, args_builder, requires_response_parser, train_logs
from transformers import AutoTokenizer

from trl import GRPOConfig, GRPOTrainer
from trl.import_utils import is_vllm_available


TOOL_CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


pytestmark = [pytest.mark.usefixtures("single_thread"), requires_response_parser]


def tool_call(name, **arguments):
    return TOOL_CALL.format(name=name, arguments=json.dumps(arguments))


class ScriptedReplies:
    """Make a causal LM generate `reply(conversation_text, turn)` (then `<|im_end|>`) for each assistant turn.

    Only cached forward passes (generation) are steered; the trainer's log-probability passes (`use_cache=False`)
    are left alone. The trainer's shared-prompt prefill is turned off so that every generate call starts from the
    rows' full contexts, which the hook follows token by token.
    """

    def __init__(self, trainer, reply):
        self.tokenizer = trainer.processing_class
        self.reply = reply
        # Token sequences that open an assistant turn (a template may continue a turn after a tool result with
        # another marker than the generation prompt's).
        self.starts = [self.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]]
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.rows = None
        self.active = False
        trainer._share_prompt_cache = False
        model = trainer.model
        model.register_forward_pre_hook(self.before, with_kwargs=True)
        model.register_forward_hook(self.after, with_kwargs=True)

    def before(self, module, args, kwargs):
        self.active = bool(kwargs.get("use_cache")) and not torch.is_grad_enabled()
        if not self.active:
            return
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1:  # first step of a generate call: the full (left-padded) contexts
            mask = kwargs.get("attention_mask")
            mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask[:, -ids.shape[1] :].bool()
            self.rows = [row[keep].tolist() for row, keep in zip(ids, mask)]
        else:
            for row, token in zip(self.rows, ids[:, 0].tolist()):
                row.append(token)

    def _next_token(self, context):
        starts = sorted(
            (i, len(start))
            for start in self.starts
            for i in range(len(context) - len(start) + 1)
            if context[i : i + len(start)] == start
        )
        position, length = starts[-1]
        generated = context[position + length :]
        turn = len(starts) - 1
        text = self.reply(self.tokenizer.decode(context[: starts[0][0]]), turn)
        script = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos]
        return script[len(generated)] if len(generated) < len(script) else self.eos

    def after(self, module, args, kwargs, output):
        if not self.active:
            return output
        logits = output.logits
        forced = torch.full_like(logits[:, -1, :], -1e4)
        for r, context in enumerate(self.rows):
            forced[r, self._next_token(context)] = 1e4
        logits[:, -1, :] = forced
        return output


make_args = args_builder(GRPOConfig, **{**GROUP_ARGS, "max_steps": 1, "max_completion_length": 64})


def chat_dataset(*questions, **columns):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions], **columns})


def train_log(trainer):
    return train_logs(trainer)[-1]


def multiplication_trainer(model_path, reward, args, tool):
    """A GRPO trainer on two "3 times 4" questions with one tool (the setting most tool-loop tests script)."""
    return GRPOTrainer(
        model_path,
        reward_funcs=reward,
        args=args,
        train_dataset=chat_dataset("What is 3 times 4?", "Compute 3*4."),
        tools=[tool],
    )


class Recorder:
    """Reward function recording what the trainer passes to reward functions."""

    __name__ = "recorder"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.calls.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
        return [float(len(ids)) for ids in completion_ids]


def make_multiply(calls):
    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: First factor.
            b: Second factor.
        """
        calls.append((a, b))
        return a * b

    return multiply


def divide(a: int, b: int) -> float:
    """Divide two integers.

    Args:
        a: Dividend.
        b: Divisor.
    """
    return a / b


# ---------------------------------------------------------------------------------------------------------------------
# The tool loop
# ---------------------------------------------------------------------------------------------------------------------
def test_tool_call_loop_masks_tool_results(tmp_path, model_path):
    calls, recorder = [], Recorder()
    multiply = make_multiply(calls)
    trainer = multiplication_trainer(model_path, recorder, make_args(tmp_path), multiply)
    ScriptedReplies(trainer, lambda text, turn: tool_call("multiply", a=3, b=4) if turn == 0 else "It is 12.")
    trainer.train()

    assert calls == [(3, 4)] * 4  # one call per generated row, with the parsed (typed) arguments
    (record,) = recorder.calls
    expected = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}],
        },
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "It is 12."},
    ]
    assert record["completions"] == [expected] * 4
    # The tools are rendered in the prompt (system message) by the chat template.
    tokenizer = trainer.processing_class
    batch = trainer._buffered_inputs[0]
    assert '"name": "multiply"' in tokenizer.decode(batch["prompt_ids"][0])

    # Completion = turn 1 + tool glue + turn 2; the glue is attended to but outside the loss.
    turn1 = tokenizer(tool_call("multiply", a=3, b=4) + "<|im_end|>", add_special_tokens=False)["input_ids"]
    glue = tokenizer(
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    turn2 = tokenizer("It is 12.<|im_end|>", add_special_tokens=False)["input_ids"]
    for ids, loss_mask, attended in zip(
        batch["completion_ids"], batch["completion_mask"] * batch["tool_mask"], batch["completion_mask"]
    ):
        length = int(attended.sum())
        assert ids[:length].tolist() == turn1 + glue + turn2
        assert loss_mask[:length].tolist() == [1] * len(turn1) + [0] * len(glue) + [1] * len(turn2)
        assert int(loss_mask.sum()) == len(turn1) + len(turn2)
    assert record["completion_ids"] == [turn1 + glue + turn2] * 4

    log = train_log(trainer)
    assert log["tools/call_frequency"] == 1.0
    assert log["tools/failure_frequency"] == 0.0
    assert log["completions/mean_length"] == len(turn1) + len(turn2) + len(glue)
    assert log["completions/clipped_ratio"] == 0.0
    assert torch.isfinite(torch.tensor(log["loss"]))


def test_tool_failures_are_reported_to_the_model_and_counted(tmp_path, model_path):
    calls, recorder = [], Recorder()
    multiply = make_multiply(calls)

    def reply(text, turn):
        if turn > 0:
            return "Done."
        if "divide" in text.split("<|im_start|>user")[-1]:
            return tool_call("divide", a=1, b=0)  # raises ZeroDivisionError
        return tool_call("multiply", a=2, b=5) + "\n" + tool_call("nope", x=1)  # second call: unknown tool

    trainer = GRPOTrainer(
        model_path,
        reward_funcs=recorder,
        args=make_args(tmp_path, max_completion_length=96),
        train_dataset=chat_dataset("Please divide.", "Please multiply."),
        tools=[multiply, divide],
    )
    ScriptedReplies(trainer, reply)
    trainer.train()

    assert calls == [(2, 5)] * 2
    completions = recorder.calls[0]["completions"]
    by_prompt = {json.dumps(p): c for p, c in zip(recorder.calls[0]["prompts"], completions)}
    divide_completion = by_prompt[json.dumps([{"role": "user", "content": "Please divide."}])]
    assert divide_completion[1]["role"] == "tool"
    assert json.loads(divide_completion[1]["content"]) == {"error": "ZeroDivisionError: division by zero"}
    assert divide_completion[2] == {"role": "assistant", "content": "Done."}
    multiply_completion = by_prompt[json.dumps([{"role": "user", "content": "Please multiply."}])]
    assert [m["name"] for m in multiply_completion[1:3]] == ["multiply", "nope"]
    assert multiply_completion[1]["content"] == "10"
    assert "does not exist" in json.loads(multiply_completion[2]["content"])["error"]

    log = train_log(trainer)
    # 2 rows x 1 call (failing) + 2 rows x 2 calls (one failing): 6 calls for 4 completions, 4 of them failed.
    assert log["tools/call_frequency"] == pytest.approx(6 / 4)
    assert log["tools/failure_frequency"] == pytest.approx(4 / 6)


def test_max_tool_calling_iterations_and_budget(tmp_path, model_path, caplog):
    calls, recorder = [], Recorder()
    multiply = make_multiply(calls)
    always_call = lambda text, turn: tool_call("multiply", a=3, b=4)  # noqa: E731
    trainer = multiplication_trainer(
        model_path,
        recorder,
        make_args(tmp_path / "cap", max_completion_length=256, max_tool_calling_iterations=2),
        multiply,
    )
    ScriptedReplies(trainer, always_call)
    trainer.train()
    assert len(calls) == 4 * 2
    roles = [m["role"] for m in recorder.calls[0]["completions"][0]]
    assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert "tool_calls" in recorder.calls[0]["completions"][0][-1]  # the last call is not executed
    log = train_log(trainer)
    assert log["tools/call_frequency"] == 2.0
    assert log["completions/clipped_ratio"] == 0.0

    # A budget smaller than turn + tool result: the completion is cut at max_completion_length, no second turn.
    calls.clear()
    trainer = multiplication_trainer(
        model_path, Recorder(), make_args(tmp_path / "budget", max_completion_length=36), multiply
    )
    ScriptedReplies(trainer, always_call)
    with caplog.at_level(logging.WARNING, logger="trl.trainer.tool_calling"):
        trainer.train()
    assert len(calls) == 4
    assert "truncated" in caplog.text
    log = train_log(trainer)
    assert log["completions/max_length"] == 36
    assert log["completions/clipped_ratio"] == 1.0


def test_async_tool(tmp_path, model_path):
    calls = []

    async def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: First factor.
            b: Second factor.
        """
        calls.append((a, b))
        return a * b

    recorder = Recorder()
    trainer = multiplication_trainer(model_path, recorder, make_args(tmp_path), multiply)
    ScriptedReplies(trainer, lambda text, turn: tool_call("multiply", a=3, b=4) if turn == 0 else "12")
    trainer.train()
    assert calls == [(3, 4)] * 4
    assert recorder.calls[0]["completions"][0][1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert train_log(trainer)["tools/failure_frequency"] == 0.0


@pytest.mark.vllm
@pytest.mark.skipif(not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)")
def test_tool_loop_with_vllm_colocate(tmp_path, model_path):
    """The same loop on vLLM: the regex of structured outputs makes every turn a tool call, so the second turn is
    generated by vLLM from the continuation token ids (and left unexecuted: max_tool_calling_iterations=1)."""
    calls, recorder = [], Recorder()
    args = make_args(
        tmp_path,
        max_completion_length=192,
        max_tool_calling_iterations=1,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=1024,
        vllm_structured_outputs_regex=re.escape(tool_call("multiply", a=3, b=4)),
    )
    trainer = multiplication_trainer(model_path, recorder, args, make_multiply(calls))
    limits, generate = [], trainer.vllm_generation.generate

    def generate_recording_limit(*args, **kwargs):
        limits.append(trainer.vllm_generation.max_tokens)
        return generate(*args, **kwargs)

    trainer.vllm_generation.generate = generate_recording_limit
    trainer.train()
    assert calls == [(3, 4)] * 4
    # The second turn may only use what the first turn and the tool result left of the 192-token budget (of the
    # row with most room left), and the engine's own limit is restored after it.
    prefixes = []  # first turn + tool result: up to the last masked-out token of each row
    for batch in trainer._buffered_inputs:
        for loss_mask, attended in zip(batch["completion_mask"] * batch["tool_mask"], batch["completion_mask"]):
            mask = loss_mask[: int(attended.sum())].tolist()
            prefixes.append(len(mask) - mask[::-1].index(0))
    assert len(prefixes) == 4 and limits[:2] == [192, 192 - min(prefixes)]
    assert trainer.vllm_generation.max_tokens == 192
    for completion in recorder.calls[0]["completions"]:
        assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
        assert completion[1]["content"] == "12"
        assert completion[2]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 3, "b": 4}}
    # Structured outputs spell the call character by character, so compare decoded text rather than token ids.
    tokenizer = trainer.processing_class
    glue_text = "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    batch = trainer._buffered_inputs[0]
    for ids, loss_mask, attended in zip(
        batch["completion_ids"], batch["completion_mask"] * batch["tool_mask"], batch["completion_mask"]
    ):
        length = int(attended.sum())
        ids, mask = ids[:length].tolist(), loss_mask[:length].tolist()
        first_zero = mask.index(0)
        last_zero = length - 1 - mask[::-1].index(0)
        assert all(mask[:first_zero]) and all(mask[last_zero + 1 :]) and not any(mask[first_zero : last_zero + 1])
        assert tokenizer.decode(ids[first_zero : last_zero + 1]) == glue_text
        assert tokenizer.decode(ids[:first_zero]) == tokenizer.decode(ids[last_zero + 1 :])  # the same forced call
    assert train_log(trainer)["tools/call_frequency"] == 1.0
    trainer.end()


# ---------------------------------------------------------------------------------------------------------------------
# Environments
# ---------------------------------------------------------------------------------------------------------------------
class CounterEnv:
    instances = []

    def __init__(self):
        self.value = 0
        CounterEnv.instances.append(self)

    def reset(self, start: int = 0, **kwargs):
        self.value = start
        return f" The counter starts at {start}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: Amount added.
        """
        self.value += step
        return self.value

    def get_reward(self) -> float:
        return float(self.value)


class QuietEnv:
    def reset(self):
        return None

    def get_reward(self) -> float:
        return -1.0


def test_environment_factory(tmp_path, model_path):
    CounterEnv.instances = []
    recorder = Recorder()
    trainer = GRPOTrainer(
        model_path,
        reward_funcs=recorder,
        args=make_args(tmp_path),
        train_dataset=chat_dataset("Count.", "Count more.", start=[1, 5]),
        environment_factory=CounterEnv,
    )
    assert trainer.reward_func_names == ["recorder", "CounterEnv"]
    ScriptedReplies(trainer, lambda text, turn: tool_call("increment", step=2) if turn == 0 else "ok")
    trainer.train()

    record = recorder.calls[0]
    environments = record["environments"]
    assert len(environments) == 4 and len({id(env) for env in environments}) == 4  # one instance per row
    assert sorted(env.value for env in environments) == [3, 3, 7, 7]
    assert sorted(p[-1]["content"] for p in record["prompts"]) == [
        "Count more. The counter starts at 5.",
        "Count more. The counter starts at 5.",
        "Count. The counter starts at 1.",
        "Count. The counter starts at 1.",
    ]
    assert record["completions"][0][1]["name"] == "increment"
    log = train_log(trainer)
    assert log["rewards/CounterEnv/mean"] == 5.0
    assert log["tools/call_frequency"] == 1.0


def test_dict_environment_factory_selects_by_column(tmp_path, model_path):
    trainer = GRPOTrainer(
        model_path,
        reward_funcs=None,
        args=make_args(tmp_path),
        train_dataset=chat_dataset("Count.", "Be quiet.", environment=["counter", "quiet"], start=[4, 0]),
        environment_factory={"counter": CounterEnv, "quiet": QuietEnv},
    )
    assert trainer.reward_func_names == ["CounterEnv", "QuietEnv"]
    ScriptedReplies(trainer, lambda text, turn: "no tools")
    trainer.train()
    log = train_log(trainer)
    assert log["rewards/CounterEnv/mean"] == 4.0  # only the counter rows are scored by it
    assert log["rewards/QuietEnv/mean"] == -1.0
    assert log["tools/call_frequency"] == 0.0
    assert log["tools/failure_frequency"] == 0.0


def test_environment_without_dataset(tmp_path, model_path):
    class TaskEnv:
        def reset(self):
            return "What is 3 times 4?"

        def get_reward(self):
            return 1.0

    recorder = Recorder()
    trainer = GRPOTrainer(model_path, reward_funcs=recorder, args=make_args(tmp_path), environment_factory=TaskEnv)
    ScriptedReplies(trainer, lambda text, turn: "12")
    trainer.train()
    assert recorder.calls[0]["prompts"] == [[{"role": "user", "content": "What is 3 times 4?"}]] * 4
    assert train_log(trainer)["rewards/TaskEnv/mean"] == 1.0

    with pytest.raises(ValueError, match="max_steps"):
        GRPOTrainer(
            model_path, reward_funcs=recorder, args=make_args(tmp_path, max_steps=-1), environment_factory=TaskEnv
        )


# ---------------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------------
def no_docstring(a: int) -> int:
    return a


def no_hints(a):
    """Identity.

    Args:
        a: Value.
    """
    return a


@pytest.mark.parametrize("tool", [no_docstring, no_hints, "multiply"])
def test_invalid_tools(tmp_path, model_path, tool):
    with pytest.raises(ValueError, match="tool|callable"):
        GRPOTrainer(
            model_path,
            reward_funcs=Recorder(),
            args=make_args(tmp_path),
            train_dataset=chat_dataset("q"),
            tools=[tool],
        )


def test_tools_need_a_tool_calling_template(tmp_path, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="cannot render tools"):
        GRPOTrainer(
            model_path,
            reward_funcs=Recorder(),
            args=make_args(tmp_path),
            train_dataset=chat_dataset("q"),
            processing_class=tokenizer,
            tools=[divide],
        )


def test_tools_with_rollout_func_rejected(tmp_path, model_path):
    with pytest.raises(ValueError, match="rollout_func"):
        GRPOTrainer(
            model_path,
            reward_funcs=Recorder(),
            args=make_args(tmp_path),
            train_dataset=chat_dataset("q"),
            tools=[divide],
            rollout_func=lambda prompts, trainer: {},
        )


def test_environment_errors(tmp_path, model_path):
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: Input.
            """
            return x

    class UndocumentedTool:
        def reset(self):
            return None

        def act(self, x):
            return x

    for factory, match in ((NoReset, "reset"), (UndocumentedTool, "UndocumentedTool")):
        with pytest.raises(ValueError, match=match):
            GRPOTrainer(
                model_path,
                reward_funcs=Recorder(),
                args=make_args(tmp_path),
                train_dataset=chat_dataset("q"),
                environment_factory=factory,
            )
    with pytest.raises(ValueError, match="'environment' column"):
        GRPOTrainer(
            model_path, reward_funcs=Recorder(), args=make_args(tmp_path), environment_factory={"a": CounterEnv}
        )


def test_tools_need_conversational_prompts(tmp_path, model_path):
    plain = Dataset.from_dict({"prompt": ["plain text", "more text"]})
    with pytest.raises(ValueError, match="conversational"):
        GRPOTrainer(model_path, reward_funcs=Recorder(), args=make_args(tmp_path), train_dataset=plain, tools=[divide])
    # Data that is only seen during the rollout (here an eval dataset) fails there, with the same message.
    trainer = GRPOTrainer(
        model_path,
        reward_funcs=Recorder(),
        args=make_args(tmp_path, per_device_eval_batch_size=2),
        train_dataset=chat_dataset("q"),
        eval_dataset=plain,
        tools=[divide],
    )
    with pytest.raises(ValueError, match="conversational"):
        trainer.evaluate()


def test_rloo_has_no_tools_argument():
    import inspect

    from trl import RLOOTrainer

    assert "tools" not in inspect.signature(RLOOTrainer.__init__).parameters


def test_tools_need_a_prefix_preserving_template(tmp_path, model_path):
    """A template that renders tools but rewrites earlier turns when a message is appended is refused before training."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = (
        "{{ messages | length }} messages\n"
        "{% if tools %}{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
        "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
        "<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="not prefix-preserving"):
        GRPOTrainer(
            model_path,
            reward_funcs=Recorder(),
            args=make_args(tmp_path),
            train_dataset=chat_dataset("q"),
            processing_class=tokenizer,
            tools=[divide],
        )

"""AsyncGRPO with tools and environments: the multi-turn rollout worker and the trainer.

A random tiny model never writes a tool call, so `ScriptedBackend` stands in for the generation server: it reads the
rendered conversation it is asked to continue and answers with a scripted reply for that turn (plus `<|im_end|>`),
with fixed sampler log-probabilities. Everything else is the real worker: rendering with the chat template, the
response parser, tool execution, environments, turn reconciliation, scoring and metrics.
"""

import json
import math
import queue
import random
import threading
import time

import numpy as np
import pytest
import torch
from datasets import Dataset
from test_async_grpo import _trainer
from test_grpo_tools import chat_dataset, divide, make_multiply
from transformers import AutoTokenizer

from trl.assets import get_model_path
from trl.experimental.async_grpo import AsyncGRPOConfig
from trl.experimental.async_grpo._conversation import prepare_tool_setup
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker


TINY = "tiny-Qwen2ForCausalLM"
LOG_PROB = -0.5
TOOL_CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'

pytestmark = pytest.mark.skipif(
    not __import__("trl._compat", fromlist=["response_content_parsers"]).response_content_parsers(),
    reason="tool calling needs transformers' response parser (transformers >= 5)",
)


def tool_call(name, separators=(", ", ": "), **arguments):
    return TOOL_CALL.format(name=name, arguments=json.dumps(arguments, separators=separators))


def tokenizer():
    return AutoTokenizer.from_pretrained(get_model_path(TINY))


class ScriptedBackend:
    """A generation backend answering `reply(conversation_text, turn)` for each turn (`turn` counts from 0)."""

    def __init__(self, reply):
        self.tokenizer = tokenizer()  # its own: the worker's threads share theirs
        self.reply = reply
        self.lock = threading.Lock()
        self.requests = []
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def check_ready(self, timeout):
        pass

    def generate(self, prompt_ids, n, sampling):
        with self.lock:
            text = self.tokenizer.decode(prompt_ids)
            turn = text.count("<|im_start|>assistant") - 1
            self.requests.append((n, turn))
            ids = self.tokenizer(self.reply(text, turn), add_special_tokens=False)["input_ids"] + [self.eos]
        ids = ids[: sampling["max_tokens"]]
        return [(list(ids), [LOG_PROB] * len(ids)) for _ in range(n)]


class Recorder:
    """Reward function recording what the worker passes to reward functions (reward: number of tool messages)."""

    __name__ = "recorder"

    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def __call__(self, completions, **kwargs):
        with self.lock:
            self.calls.append({"completions": completions, **kwargs})
        return [float(sum(m["role"] == "tool" for m in completion)) for completion in completions]


def run_worker(dataset, reply, reward_funcs=(), groups=2, num_generations=2, **loop_kwargs):
    """Run the worker until `groups` groups were scored; returns its samples by group, its metrics and backend."""
    backend = ScriptedBackend(reply)
    reward_funcs = list(reward_funcs)
    worker = AsyncRolloutWorker(
        backend=backend, dataset=dataset, tokenizer=tokenizer(), reward_funcs=reward_funcs,
        reward_func_names=[f.__name__ for f in reward_funcs], num_generations=num_generations,
        max_completion_length=64, max_inflight_tasks=4, **loop_kwargs,
    )  # fmt: skip
    samples, metrics = collect(worker, groups)
    return samples, metrics, backend, worker


def collect(worker, groups):
    """Start the worker, stop it once `groups` groups were scored; returns its samples by group and its metrics."""
    worker.start()
    metrics = []
    deadline = time.time() + 60
    try:
        while len(metrics) < groups and time.time() < deadline:
            try:
                metrics.append(worker.metrics_queue.get(timeout=0.2))
            except queue.Empty:
                worker.check_health(60)
    finally:
        worker.stop()
    assert len(metrics) >= groups, "the worker scored too few groups"
    samples = {}
    while True:
        try:
            sample = worker.rollout_buffer.get_nowait()
        except queue.Empty:
            return samples, metrics
        samples.setdefault(sample.group_id, []).append(sample)


def scored_group(samples, size):
    """The samples of a group that was queued in full (`size` samples)."""
    return next(group for _, group in sorted(samples.items()) if len(group) == size)


@pytest.mark.timeout(120)
def test_tool_call_then_answer_builds_masked_rows_and_metrics():
    calls = []
    recorder = Recorder()

    def reply(text, turn):
        return tool_call("multiply", a=3, b=4) if turn == 0 else "The answer is 12."

    samples, metrics, backend, _ = run_worker(
        chat_dataset("What is 3 times 4?"), reply, reward_funcs=[recorder], tools=[make_multiply(calls)]
    )
    assert calls and set(calls) == {(3, 4)}
    assert all(n == 1 for n, _ in backend.requests)  # one request per conversation and turn
    # The reward function saw the whole conversation after the prompt.
    completion = recorder.calls[0]["completions"][0]
    assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
    assert completion[0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 3, "b": 4}}
    assert completion[1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert completion[2]["content"] == "The answer is 12."
    assert recorder.calls[0]["prompts"][0] == [{"role": "user", "content": "What is 3 times 4?"}]
    # One row per conversation: the turns extend each other (clean); tool results and turn markers are context.
    group = scored_group(samples, 2)
    sample = group[0]
    tok = tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    turn0 = tok(tool_call("multiply", a=3, b=4), add_special_tokens=False)["input_ids"] + [eos]
    turn1 = tok("The answer is 12.", add_special_tokens=False)["input_ids"] + [eos]
    mask = sample.completion_mask.tolist()
    trained = sample.input_ids[sample.completion_mask == 1].tolist()
    assert trained == turn0 + turn1
    assert recorder.calls[0]["completion_ids"][0] == turn0 + turn1
    # Layout: [prompt: 0] [turn 0: 1] [tool result, next turn marker: 0] [turn 1: 1].
    first_trained = mask.index(1)
    runs = [mask[first_trained]]
    for value in mask[first_trained:]:
        if value != runs[-1]:
            runs.append(value)
    assert runs == [1, 0, 1]
    glue = tok.decode(sample.input_ids[first_trained + len(turn0) : len(mask) - len(turn1)])
    assert "<tool_response>\n12\n</tool_response>" in glue and glue.endswith("<|im_start|>assistant\n")
    np.testing.assert_allclose(sample.old_log_probs[sample.completion_mask == 1], LOG_PROB)
    assert not sample.old_log_probs[sample.completion_mask == 0].any()
    assert sample.metrics["reward"] == 1.0 and sample.metrics["rewards/recorder"] == 1.0
    assert sample.metrics["tools/call_frequency"] == 1.0 and sample.metrics["tools/failure_frequency"] == 0.0
    assert sample.advantage == 0.0  # both conversations alike
    # Metrics with TRL's keys.
    m = metrics[0]
    assert (m["rollout/turns_mean"], m["rollout/turns_max"]) == (2.0, 2.0)
    assert (m["rollout/fork_frac"], m["rollout/realign_frac"], m["rollout/drift_tokens_max"]) == (0.0, 0.0, 0.0)
    assert m["tools/multiply/call_total"] == 2.0 and m["tools/multiply/failure_total"] == 0.0
    assert m["tools/unknown_name_total"] == 0.0 and m["tools/loop_exhausted_frac"] == 0.0
    assert m["tools/parallel_calls_mean"] == 1.0
    assert m["tools/latency_s"] >= 0.0 and m["tools/multiply/latency_s"] >= 0.0
    assert m["rollout/samples_per_rollout"] == 1.0 and "rollout/inflight" in m
    assert m["completions/mean_length"] == len(turn0 + turn1)


@pytest.mark.timeout(120)
def test_unknown_tools_failures_and_exhausted_loop_are_counted():
    calls = []

    def reply(text, turn):
        if turn == 0:  # two calls at once: an unknown tool and a failing one
            return tool_call("nope", x=1) + "\n" + tool_call("divide", a=1, b=0)
        return tool_call("multiply", a=2, b=2)  # the limit is reached: not executed

    async def recorder(completions, **kwargs):
        return [1.0] * len(completions)

    samples, metrics, _, _ = run_worker(
        chat_dataset("Go."), reply, reward_funcs=[recorder], tools=[make_multiply(calls), divide],
        max_tool_calling_iterations=1,
    )  # fmt: skip
    assert calls == []
    sample = scored_group(samples, 2)[0]
    tool_messages = [m for m in sample.completion if m["role"] == "tool"]
    assert [m["name"] for m in tool_messages] == ["nope", "divide"]
    # TRL's tool message content: str() of the result, here the error dict.
    assert tool_messages[0]["content"].startswith("{'error': \"Tool 'nope' does not exist")
    assert tool_messages[1]["content"] == "{'error': 'ZeroDivisionError: division by zero'}"
    assert sample.completion[-1]["tool_calls"][0]["function"]["name"] == "multiply"
    assert sample.metrics["tools/call_frequency"] == 2.0 and sample.metrics["tools/failure_frequency"] == 1.0
    m = metrics[0]
    assert m["tools/unknown_name_total"] == 2.0
    assert m["tools/divide/call_total"] == 2.0 and m["tools/divide/failure_total"] == 2.0
    assert m["tools/multiply/call_total"] == 0.0
    assert m["tools/loop_exhausted_frac"] == 1.0 and m["tools/parallel_calls_mean"] == 2.0
    assert m["rollout/turns_max"] == 2.0


@pytest.mark.timeout(120)
def test_reformatted_tool_call_realigns_or_forks():
    def reply(text, turn):  # compact JSON: the template re-renders the call with spaces, the tokens drift
        return tool_call("multiply", separators=(",", ":"), a=3, b=4) if turn == 0 else "12"

    dataset = chat_dataset("What is 3 times 4?")
    samples, metrics, _, _ = run_worker(dataset, reply, reward_funcs=[Recorder()], tools=[make_multiply([])])
    m = metrics[0]
    assert m["rollout/realign_frac"] == 1.0 and m["rollout/fork_frac"] == 0.0 and m["rollout/drift_tokens_max"] > 0
    sample = scored_group(samples, 2)[0]
    # Realigned: the held tail from the first differing token was replaced by the re-rendered (untrained) call.
    tok = tokenizer()
    assert tok.decode(sample.input_ids).count('{"name": "multiply", "arguments": {"a": 3, "b": 4}}') == 1
    samples, metrics, _, _ = run_worker(
        dataset, reply, reward_funcs=[Recorder()], tools=[make_multiply([])], fork_threshold_tokens=1
    )
    assert metrics[0]["rollout/fork_frac"] == 1.0 and metrics[0]["rollout/samples_per_rollout"] == 2.0
    group = scored_group(samples, 4)
    assert len({s.advantage for s in group}) == 1  # every row of a conversation has its advantage


class CounterEnv:
    instances = []

    def __init__(self):
        type(self).instances.append(self)
        self.value = 0
        self.resets = []

    def reset(self, start, **kwargs):
        self.resets.append({"start": start, **kwargs})
        self.value = start
        return f" Start at {start}."

    def increment(self, step: int) -> int:
        """Increase the counter.

        Args:
            step: Amount to add.
        """
        self.value += step
        return self.value

    def get_reward(self):
        return float(self.value)


@pytest.mark.timeout(120)
def test_environment_reset_tools_and_reward_column():
    CounterEnv.instances = []

    def reply(text, turn):
        return tool_call("increment", step=2) if turn == 0 else "done"

    dataset = chat_dataset("Count.", start=[5])
    samples, metrics, _, worker = run_worker(dataset, reply, environment_factory=CounterEnv, groups=6)
    sample = scored_group(samples, 2)[0]
    # The observation was appended to the last prompt message, and the method ran as a tool.
    assert sample.prompt == [{"role": "user", "content": "Count. Start at 5."}]
    assert sample.completion[1] == {"role": "tool", "name": "increment", "content": "7"}
    assert sample.metrics["rewards/CounterEnv"] == 7.0 and sample.metrics["reward"] == 7.0
    m = metrics[0]
    assert m["tools/increment/call_total"] == 2.0 and m["env/reset_s"] >= 0.0 and m["env/reward_s"] >= 0.0
    # Instances are pooled and reused: one per running conversation (4 slots) or finished one whose group is not
    # scored yet (at most one sibling per open group here), the probe included.
    assert len(CounterEnv.instances) <= 4 + 4
    assert sum(len(env.resets) for env in CounterEnv.instances) > len(CounterEnv.instances)
    assert all(env in worker._tool_runtime.pool._free[None] for env in CounterEnv.instances)  # all handed back
    assert CounterEnv.instances[0].resets[0]["prompt"] == [{"role": "user", "content": "Count."}]


class AlphaEnv:
    def reset(self, **kwargs):
        assert "environment" not in kwargs
        return " (alpha)"

    def get_reward(self):
        return 1.0


class BetaEnv:
    def reset(self, **kwargs):
        assert "environment" not in kwargs
        return [{"type": "text", "text": "beta"}]

    def shout(self, text: str) -> str:
        """Shout a text.

        Args:
            text: What to shout.
        """
        return text.upper()


@pytest.mark.timeout(120)
def test_dict_environment_factory_selects_by_column():
    def reply(text, turn):
        return "plain answer"

    dataset = chat_dataset("A?", "B?", environment=["alpha", "beta"])
    samples, metrics, _, _ = run_worker(
        dataset, reply, environment_factory={"alpha": AlphaEnv, "beta": BetaEnv}, groups=4
    )
    by_env = {}
    for group in samples.values():
        if len(group) == 2:
            by_env[group[0].prompt[0]["content"] if isinstance(group[0].prompt[0]["content"], str) else "B"] = group
    alpha, beta = by_env["A? (alpha)"], by_env["B"]
    assert beta[0].prompt[0]["content"] == [{"type": "text", "text": "B?"}, {"type": "text", "text": "beta"}]
    assert alpha[0].metrics["rewards/AlphaEnv"] == 1.0 and alpha[0].metrics["reward"] == 1.0
    # BetaEnv has no reward: its rows have no reward at all, so they are unscored (reward NaN, advantage 0).
    assert math.isnan(beta[0].metrics["rewards/AlphaEnv"]) and math.isnan(beta[0].metrics["reward"])
    assert all(s.advantage == 0.0 for s in beta)
    assert "tools/call_frequency" not in alpha[0].metrics  # no tool was called


def test_bad_tool_and_environment_inputs_are_refused_with_clear_messages():
    class NoReset:
        def step(self, x: int) -> int:
            """Step.

            Args:
                x: Value.
            """
            return x

    args = AsyncGRPOConfig("out", use_cpu=True, max_steps=2, per_device_train_batch_size=3, report_to="none")
    with pytest.raises(ValueError, match="has no reset"):
        prepare_tool_setup(None, NoReset, args, chat_dataset("x"))
    factories = {"alpha": AlphaEnv, "beta": BetaEnv}
    with pytest.raises(ValueError, match=r"'environment' column; the dataset has the columns \['prompt'\]"):
        prepare_tool_setup(None, factories, args, chat_dataset("x"))
    with pytest.raises(ValueError, match=r"names \['gamma'\], which environment_factory does not define"):
        prepare_tool_setup(None, factories, args, chat_dataset("x", environment=["gamma"]))
    with pytest.raises(ValueError, match="'environment' column"):
        prepare_tool_setup(None, factories, args, None)
    with pytest.raises(ValueError, match="cannot be described"):
        prepare_tool_setup([lambda x: x], None, args, chat_dataset("x"))
    with pytest.raises(ValueError, match="conversational prompts"):
        prepare_tool_setup([divide], None, args, Dataset.from_dict({"prompt": ["text"]}))
    no_steps = AsyncGRPOConfig("out", use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="max_steps"):
        prepare_tool_setup(None, CounterEnv, no_steps, None)
    # A single factory without a dataset: per_device_train_batch_size · gradient_accumulation_steps empty prompts.
    tools, pool, dataset = prepare_tool_setup(None, AlphaEnv, args, None)
    assert tools == [] and pool.classes() == {None: AlphaEnv}
    assert dataset["prompt"] == [[{"role": "user", "content": ""}]] * 3
    with pytest.raises(ValueError, match="no 'prompt' column"):
        prepare_tool_setup(None, factories, args, Dataset.from_dict({"environment": ["alpha"]}))
    # Without a prompt column, the other columns stay (reset receives them).
    _, _, dataset = prepare_tool_setup(None, CounterEnv, args, Dataset.from_dict({"start": [1, 2]}))
    assert dataset.column_names == ["start", "prompt"]


@pytest.mark.timeout(60)
def test_trainer_refuses_bad_environment_before_loading_anything(tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    args = AsyncGRPOConfig(str(tmp_path), use_cpu=True, max_steps=1, report_to="none")
    with pytest.raises(ValueError, match="'environment' column"):
        AsyncGRPOTrainer(
            "not/a-model", args=args, train_dataset=chat_dataset("x"), environment_factory={"a": AlphaEnv}
        )


class LocalTransfer:
    def __init__(self):
        self.events = []

    def init_weight_transfer(self):
        self.events.append("init")

    def pause(self):
        pass

    def send_weights(self, iterator):
        self.events.append(("send", sum(1 for _ in iterator)))

    def resume(self):
        pass

    def destroy(self):
        self.events.append("destroy")


def local_trainer(backend, tmp_path, reward_funcs=None, train_dataset=None, **trainer_kwargs):
    """AsyncGRPO's test trainer (`test_async_grpo._trainer`) on the scripted backend: 2 steps of 4 samples."""
    config = {"max_steps": 2, "max_completion_length": 32, "token_budget": 512}
    config.update(trainer_kwargs.pop("config", {}))
    return _trainer(
        tmp_path, backend, LocalTransfer(), reward_funcs=reward_funcs, train_dataset=train_dataset,
        trainer_kwargs=trainer_kwargs, **config,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_trainer_with_an_environment_and_no_dataset(tmp_path):
    trainer = local_trainer(ScriptedBackend(lambda text, turn: "ok"), tmp_path, environment_factory=AlphaEnv)
    assert trainer.train_dataset["prompt"] == [[{"role": "user", "content": ""}]] * 4
    trainer.train()
    assert trainer.state.global_step == 2
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"rewards/AlphaEnv", "env/reset_s", "env/reward_s", "rollout/turns_mean"} <= logged


@pytest.mark.timeout(300)
def test_trainer_trains_with_tools(tmp_path):

    calls = []
    rng = random.Random(0)

    def reply(text, turn):  # half of the conversations call the tool: rewards differ within groups
        if turn == 0 and rng.random() < 0.5:
            return tool_call("multiply", a=3, b=4)
        return "12"

    def used_tool(completions, **kwargs):
        return [float(any(m["role"] == "tool" for m in c)) for c in completions]

    trainer = local_trainer(
        ScriptedBackend(reply), tmp_path, reward_funcs=used_tool, train_dataset=chat_dataset("3*4?", "4*3?"),
        tools=[make_multiply(calls)], config={"max_tool_calling_iterations": 2},
    )  # fmt: skip
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2 and calls
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert not trainer.rollout_worker._thread.is_alive()
    logged = {key for entry in trainer.state.log_history for key in entry}
    expected = {
        "loss", "reward", "rewards/used_tool", "rollout/turns_mean", "rollout/turns_max", "rollout/fork_frac",
        "rollout/realign_frac", "rollout/drift_tokens_mean", "rollout/drift_tokens_max", "rollout/inflight",
        "tools/loop_exhausted_frac", "tools/multiply/call_total", "tools/multiply/failure_total",
        "tools/unknown_name_total", "tools/call_frequency", "tools/failure_frequency",
    }  # fmt: skip
    assert expected <= logged, expected - logged

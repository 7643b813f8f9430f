"""AsyncGRPO's OpenEnv harness worker (`async_grpo.openenv_harness.HarnessRolloutWorker`).

Both modes run against scripted harness sessions, with `ScriptedBackend` (test_async_grpo_tools) standing in for the
generation server. OpenEnv itself: the real `openenv.core.harness` when it imports, else the stand-in of
`openenv_stub/` (the real package needs FastAPI, FastMCP and Gradio, see its README). No real OpenEnv server runs here.
"""

import importlib
import importlib.util
import math
import os
import random
import sys
import threading
import time

import pytest
from test_async_grpo import _trainer
from test_async_grpo_tools import LOG_PROB, LocalTransfer, ScriptedBackend, collect, tokenizer, tool_call
from test_grpo_tools import chat_dataset


STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openenv_stub")
MODULE = "trl.experimental.async_grpo.openenv_harness"

pytestmark = pytest.mark.skipif(
    not __import__("trl._compat", fromlist=["response_content_parsers"]).response_content_parsers(),
    reason="harness turns are parsed with transformers' response parser (transformers >= 5)",
)


def _real_openenv_harness() -> bool:
    if importlib.util.find_spec("openenv") is None:
        return False
    try:
        importlib.import_module("openenv.core.harness")
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def oe():
    """`(openenv.core.harness, the openenv_harness module)`: the real OpenEnv when it imports, else the stand-in
    (put on `sys.path` for this module only, so other tests still see OpenEnv missing)."""
    use_stub = not _real_openenv_harness()
    if use_stub:
        sys.path.insert(0, STUB)
        for name in [n for n in sys.modules if n == "openenv" or n.startswith("openenv.")]:
            del sys.modules[name]
    try:
        harness = importlib.import_module("openenv.core.harness")
        yield harness, importlib.import_module(MODULE)
    finally:
        if use_stub:
            sys.path.remove(STUB)
            for name in [n for n in sys.modules if n == MODULE or n == "openenv" or n.startswith("openenv.")]:
                del sys.modules[name]


def make_worker(module, reply, dataset=None, num_generations=2, **kwargs):
    backend = ScriptedBackend(reply)
    kwargs.setdefault("reward_funcs", [])
    worker = module.HarnessRolloutWorker(
        backend=backend, dataset=dataset or chat_dataset("What is 3 times 4?"), tokenizer=tokenizer(),
        reward_func_names=[f.__name__ for f in kwargs["reward_funcs"]], num_generations=num_generations,
        max_completion_length=64, max_inflight_tasks=4, temperature=0.7, top_p=0.9, **kwargs,
    )  # fmt: skip
    return worker, backend


def run(worker, groups=2):
    """Run the worker until `groups` groups were scored; returns its samples by group and its metrics."""
    return collect(worker, groups)


def run_one(worker, row=None):
    """One rollout, on this thread (what a worker thread runs per rollout)."""
    row = row or {"prompt": [{"role": "user", "content": "What is 3 times 4?"}]}
    kwargs = worker.loop_kwargs

    def sampling():
        from trl.experimental.async_grpo.async_rollout_worker import _sampling_settings

        return _sampling_settings(None, kwargs)

    return worker._run_conversation(row, kwargs["backend"], sampling, threading.Event(), lambda: None)


# -- adapter mode: an OpenEnv ResourceSession and the white-box MCP loop ---------------------------------------------


def multiplication_sessions(harness, created):
    """A `ResourceSessionFactory` whose sessions ask for 3 × 4, offer a `multiply` tool and reward a final "12"."""

    class Session(harness.ResourceSession):
        def __init__(self, task):
            self.task, self.calls, self.closed = task, [], False

        def initial_messages(self):
            return [dict(message) for message in self.task["prompt"]]

        def list_tools(self):
            schema = {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            }
            return [harness.Tool(name="multiply", description="Multiply two integers.", input_schema=schema)]

        def call_tool(self, name, arguments):
            self.calls.append((name, arguments))
            if set(arguments) != {"a", "b"}:
                return harness.ToolResult(error="multiply takes a and b")
            return harness.ToolResult(data=arguments["a"] * arguments["b"])

        def verify(self, transcript, final_state=None):
            self.transcript, self.final_state = transcript, final_state
            answer = transcript[-1].get("content") or ""
            return harness.VerifyResult(env_reward=float("12" in answer), done=True)

        def close(self):
            self.closed = True

    class Factory(harness.ResourceSessionFactory):
        def create(self, task, seed=None, episode_id=None):
            session = Session(task)
            created.append(session)
            return session

    return Factory()


class RecordingAdapter:
    """OpenEnv's MCP adapter, remembering the limits it was given."""

    def __init__(self, harness):
        self.inner, self.limits = harness.MCPHarnessAdapter(), []

    def run_white_box(self, model_step, session, limits=None):
        self.limits.append(limits)
        return self.inner.run_white_box(model_step, session, limits)


@pytest.mark.timeout(120)
def test_adapter_mode_samples_every_turn_and_scores_the_harness_reward(oe):
    harness, module = oe
    created = []
    adapter = RecordingAdapter(harness)

    def reply(text, turn):  # the first conversation of each group answers wrong: rewards differ within groups
        return tool_call("multiply", a=3, b=4) if turn == 0 else ("The answer is 12." if "12" in text else "no")

    worker, backend = make_worker(
        module, reply, harness_session_factory=multiplication_sessions(harness, created), harness_adapter=adapter
    )
    samples, metrics = run(worker)
    assert all(n == 1 for n, _ in backend.requests)  # TRL sampled each turn, one request per turn
    session = created[0]
    assert session.calls == [("multiply", {"a": 3, "b": 4})] and session.closed
    assert [m["role"] for m in session.transcript] == ["user", "assistant", "tool", "assistant"]
    limits = adapter.limits[0]
    assert limits.max_turns == module.DEFAULT_MAX_TURNS == 8
    assert limits.sampling["temperature"] == 0.7 and limits.sampling["top_p"] == 0.9
    group = next(group for group in samples.values() if len(group) == 2)
    for sample in group:
        assert sample.metrics["rewards/harness_reward"] == 1.0 and sample.metrics["reward"] == 1.0
        assert sample.advantage == 0.0  # equal rewards
        assert [m["role"] for m in sample.completion] == ["assistant", "tool", "assistant"]
        # Both turns in one row: the re-rendered transcript extends the held tokens (lossless).
        trained = [lp for lp, m in zip(sample.old_log_probs, sample.completion_mask, strict=True) if m]
        assert trained and all(lp == LOG_PROB for lp in trained)
        assert 0 < sum(sample.completion_mask) < len(sample.input_ids)
    assert metrics[0]["rollout/correctness_mean"] == 1.0
    assert metrics[0]["rollout/turns_mean"] == 2.0 and metrics[0]["rollout/fork_frac"] == 0.0
    assert metrics[0]["tools/multiply/call_total"] == 2.0 and metrics[0]["tools/multiply/failure_total"] == 0.0
    assert group[0].metrics["tools/call_frequency"] == 1.0 and group[0].metrics["tools/failure_frequency"] == 0.0


# -- loop-owning mode: the harness runs the conversation ---------------------------------------------------------------


class AskTwice:
    """A loop-owning harness: asks, lets the model answer, asks for a final answer, rewards a final "12"."""

    made = []

    def __init__(self, task, sampling, model_step):
        self.task, self.sampling, self.model_step, self.closed = task, sampling, model_step, False
        AskTwice.made.append(self)

    def run(self):
        messages = list(self.task["prompt"])
        for follow_up in ("Final answer only, please.", None):
            step = self.model_step(messages, [], self.sampling)
            messages.append(step.response.to_message_dict())
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        answer = messages[-1]["content"]
        return oe_module().HarnessRolloutOutcome(env_reward=float(answer == "12"), completion=messages[1:])

    def close(self):
        self.closed = True


def oe_module():
    return sys.modules[MODULE]


@pytest.mark.timeout(120)
def test_loop_owning_mode_gets_the_sampler_settings_and_reward_fn_maps_outcomes(oe):
    _, module = oe
    AskTwice.made.clear()
    rng = random.Random(0)

    def reply(text, turn):
        return "Let me think." if turn == 0 else rng.choice(["12", "13"])

    seen = []

    def reward_fn(outcome):
        seen.append(outcome)
        return 2.0 * outcome.env_reward

    worker, backend = make_worker(module, reply, harness_session_factory=AskTwice, rollout_reward_fn=reward_fn)
    samples, metrics = run(worker, groups=3)
    harness = AskTwice.made[0]
    assert harness.closed and harness.task == {"prompt": [{"role": "user", "content": "What is 3 times 4?"}]}
    assert harness.sampling["temperature"] == 0.7 and harness.sampling["top_p"] == 0.9
    assert harness.sampling["max_tokens"] == 64
    assert all(isinstance(outcome, module.HarnessRolloutOutcome) for outcome in seen)
    for group in samples.values():
        for sample in group:
            assert sample.metrics["rewards/harness_reward"] in (0.0, 2.0)
            assert [m["role"] for m in sample.completion] == ["assistant", "user", "assistant"]
        rewards = [s.metrics["rewards/harness_reward"] for s in group]
        if len(group) == 2 and len(set(rewards)) == 2:  # the better answer gets the positive advantage
            assert max(group, key=lambda s: s.metrics["reward"]).advantage > 0
    assert {m["rollout/turns_mean"] for m in metrics} == {2.0}
    assert {m["rollout/fork_frac"] for m in metrics} == {0.0}
    correctness = [m["rollout/correctness_mean"] for m in metrics]
    assert all(0.0 <= value <= 1.0 for value in correctness)


@pytest.mark.timeout(120)
def test_a_harness_sampling_elsewhere_reports_its_turns_in_the_trace(oe):
    _, module = oe
    tok = tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    answer = tok("12", add_special_tokens=False)["input_ids"]

    def factory(sampling):
        class Harness:
            def run(self):
                turn = {"prompt_ids": prompt_ids, "completion_ids": answer, "logprobs": [-0.25] * len(answer)}
                return module.HarnessRolloutOutcome(1.0, [{"role": "assistant", "content": "12"}], trace=[turn])

        return Harness()

    worker, _ = make_worker(module, lambda text, turn: "unused", harness_session_factory=factory)
    result = run_one(worker)
    assert len(result.turns) == 1 and result.turns[0].output_ids == answer and result.turns[0].prompt_ids == prompt_ids
    assert result.turns[0].output_log_probs == [-0.25] * len(answer)
    assert result.completion_ids == answer and result.harness_reward == 1.0


# -- lossless capture --------------------------------------------------------------------------------------------------


class RewritesHistory(AskTwice):
    """Rewrites the question before the second turn: the transcript is no longer append-only."""

    def run(self):
        messages = list(self.task["prompt"])
        step = self.model_step(messages, [], self.sampling)
        messages = [{"role": "user", "content": "What is four times three?"}, step.response.to_message_dict()]
        messages.append({"role": "user", "content": "Final answer only, please."})
        step = self.model_step(messages, [], self.sampling)
        return oe_module().HarnessRolloutOutcome(1.0, [*messages[1:], step.response.to_message_dict()])


@pytest.mark.timeout(120)
def test_a_turn_that_does_not_extend_the_held_tokens_breaks_lossless_capture(oe):
    _, module = oe
    worker, backend = make_worker(module, lambda text, turn: "12", harness_session_factory=RewritesHistory)
    with pytest.raises(module.CaptureContractError, match="cannot be captured losslessly.*lossless_capture=False"):
        run_one(worker)
    assert len(backend.requests) == 1  # refused before sampling the violating turn
    # In the worker, the error fails it: the trainer sees it through check_health.
    worker, _ = make_worker(module, lambda text, turn: "12", harness_session_factory=RewritesHistory)
    with pytest.raises(RuntimeError, match="rollout worker failed") as info:
        worker.start()  # the loop can fail before `start` returns: then `start` raises it
        deadline = time.time() + 30
        while not worker._failed.is_set() and time.time() < deadline:
            time.sleep(0.05)
        worker.check_health(60)
    worker.stop()
    assert isinstance(info.value.__cause__, module.CaptureContractError)


@pytest.mark.timeout(120)
def test_without_lossless_capture_the_rewritten_turn_forks_a_new_row(oe):
    _, module = oe
    worker, _ = make_worker(
        module, lambda text, turn: "12", harness_session_factory=RewritesHistory, lossless_capture=False
    )
    samples, metrics = run(worker)
    group = next(group for group in samples.values() if len(group) == 4)  # 2 rollouts x 2 rows
    assert metrics[0]["rollout/fork_frac"] == 1.0
    assert {s.metrics["rewards/harness_reward"] for s in group} == {1.0}


@pytest.mark.timeout(60)
def test_a_rollout_without_a_captured_turn_is_refused(oe):
    _, module = oe

    def factory():
        class Silent:
            def run(self):
                return module.HarnessRolloutOutcome(1.0, [{"role": "assistant", "content": "12"}])

        return Silent()

    worker, _ = make_worker(module, lambda text, turn: "", harness_session_factory=factory)
    with pytest.raises(module.CaptureContractError, match="no turn TRL could train on"):
        run_one(worker)


# -- turn cap ----------------------------------------------------------------------------------------------------------


class NeverStops(AskTwice):
    """Keeps asking until the worker ends the rollout."""

    def run(self):
        messages = list(self.task["prompt"])
        while True:
            step = self.model_step(messages, [], self.sampling)
            messages += [step.response.to_message_dict(), {"role": "user", "content": "Go on."}]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("iterations, cap", [(None, 8), (2, 3)])
def test_turn_cap_ends_a_loop_owning_rollout(oe, iterations, cap):
    _, module = oe
    NeverStops.made.clear()
    worker, backend = make_worker(
        module, lambda text, turn: "more", harness_session_factory=NeverStops, max_tool_calling_iterations=iterations,
        rollout_reward_fn=lambda outcome: -1.0 if outcome.timed_out else outcome.env_reward,
    )  # fmt: skip
    result = run_one(worker)
    assert len(result.turns) == cap and len(backend.requests) == cap
    assert result.exhausted and result.outcome.timed_out and result.outcome.env_reward is None
    assert result.harness_reward == -1.0 and NeverStops.made[-1].closed
    assert [m["role"] for m in result.completion] == ["assistant", "user"] * (cap - 1) + ["assistant"]


@pytest.mark.timeout(120)
def test_turn_cap_reaches_the_adapter_and_unfinished_rollouts_are_counted(oe):
    harness, module = oe
    adapter = RecordingAdapter(harness)
    worker, _ = make_worker(
        module, lambda text, turn: tool_call("multiply", a=3, b=turn), harness_adapter=adapter,
        harness_session_factory=multiplication_sessions(harness, []), max_tool_calling_iterations=1,
    )  # fmt: skip
    samples, metrics = run(worker)
    assert adapter.limits[0].max_turns == 2
    assert metrics[0]["rollout/turns_max"] == 2.0
    assert metrics[0]["rollout/correctness_mean"] == 0.0  # no final answer
    assert metrics[0]["tools/multiply/call_total"] == 4.0


# -- bad inputs --------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_bad_inputs_are_refused_with_clear_messages(oe):
    harness, module = oe
    backend = ScriptedBackend(lambda text, turn: "")
    base = {"backend": backend, "dataset": chat_dataset("x"), "tokenizer": tokenizer(), "reward_funcs": []}
    with pytest.raises(TypeError, match="needs `harness_session_factory=`.*HarnessRolloutOutcome"):
        module.HarnessRolloutWorker(**base)
    with pytest.raises(TypeError, match="needs `harness_session_factory=`"):
        module.HarnessRolloutWorker(harness_session_factory="not callable", **base)
    with pytest.raises(TypeError, match="white-box HarnessAdapter with `run_white_box"):
        module.HarnessRolloutWorker(harness_session_factory=AskTwice, harness_adapter=object(), **base)
    with pytest.raises(TypeError, match="`rollout_reward_fn` must map"):
        module.HarnessRolloutWorker(harness_session_factory=AskTwice, rollout_reward_fn=1.0, **base)
    with pytest.raises(ValueError, match="tools from the harness sessions"):
        module.HarnessRolloutWorker(harness_session_factory=AskTwice, tools=[len], **base)
    with pytest.raises(TypeError, match="needs `tokenizer=`"):
        module.HarnessRolloutWorker(harness_session_factory=AskTwice, **{**base, "tokenizer": None})

    def returns_a_dict():
        class Harness:
            def run(self):
                return {"env_reward": 1.0}

        return Harness()

    worker = module.HarnessRolloutWorker(harness_session_factory=returns_a_dict, **base)
    with pytest.raises(TypeError, match="must return a HarnessRolloutOutcome; got dict"):
        run_one(worker)


# -- training ----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_async_grpo_trains_with_the_harness_worker_injected(oe, tmp_path):
    harness, module = oe
    rng = random.Random(0)

    def reply(text, turn):  # a random half answers right: rewards differ within groups
        if turn == 0:
            return tool_call("multiply", a=3, b=4)
        return "12" if rng.random() < 0.5 else "7"

    dataset = chat_dataset("3*4?", "4*3?")
    worker, backend = make_worker(
        module, reply, dataset=dataset, num_generations=4, harness_adapter=harness.MCPHarnessAdapter(),
        harness_session_factory=multiplication_sessions(harness, []),
    )  # fmt: skip
    trainer = _trainer(
        tmp_path, backend, LocalTransfer(), train_dataset=dataset, trainer_kwargs={"rollout_worker": worker},
        max_steps=2, max_completion_length=32, token_budget=512,
    )  # fmt: skip
    assert trainer.rollout_worker is worker
    trainer.train()
    assert trainer.state.global_step == 2
    assert not worker._thread.is_alive()
    logged = {key for entry in trainer.state.log_history for key in entry}
    expected = {
        "loss", "reward", "rewards/harness_reward", "rollout/correctness_mean", "rollout/turns_mean",
        "tools/multiply/call_total", "tools/call_frequency", "tools/failure_frequency",
    }  # fmt: skip
    assert expected <= logged, expected - logged
    rewards = [
        entry["rewards/harness_reward"] for entry in trainer.state.log_history if "rewards/harness_reward" in entry
    ]
    assert all(0.0 <= value <= 1.0 and not math.isnan(value) for value in rewards)

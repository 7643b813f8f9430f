"""OpenEnv harness rollouts for AsyncGRPO (requires the `openenv` package, imported with this module).

[`HarnessRolloutWorker`] drives one OpenEnv session per rollout, in one of two modes:

- **Loop-owning** (no `harness_adapter`): `harness_session_factory(task=row, sampling=..., model_step=...,
  max_turns=...)` (each keyword passed only when the factory accepts it) returns a session whose `run()` plays the
  whole rollout and returns a [`HarnessRolloutOutcome`]. `sampling` holds the training sampler's settings; the
  harness samples every model turn through `model_step`, TRL's sampler, or (when it samples elsewhere) reports each
  turn's token ids in `outcome.trace` (entries with `prompt_ids`, `completion_ids`, `logprobs`).
- **Adapter** (`harness_adapter`, an OpenEnv white-box `HarnessAdapter` such as `MCPHarnessAdapter`): TRL creates
  the session (`harness_session_factory.create(task=row)` for an OpenEnv `ResourceSessionFactory`, else
  `harness_session_factory(task=row)`), and the adapter maps between the session (initial messages, tools, tool
  calls) and the conversation while every turn is sampled by TRL's generation backend through `model_step`
  (`adapter.run_white_box(model_step, session, HarnessRunLimits(max_turns, sampling))`); the reward is what
  `session.verify(...)` forwards from the environment (else the last tool result's `reward`), then `close()`.

`model_step` is OpenEnv's `ModelStep`: `(messages, tools, sampling) -> ModelStepResult`. It renders the messages
with the chat template, checks that they extend the tokens already held for the rollout (lossless capture: the harness
may only append to the transcript) and samples one turn with the trainer's sampler settings (a harness's own
`sampling` is ignored: the sampler log-probabilities the loss uses are those of the trainer's temperature). Turns are
capped at `max_tool_calling_iterations + 1`, 8 by default. Scoring, reconciliation into training rows, advantages and
metrics are the multi-turn worker's; the reward column is `harness_reward`.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import openenv  # noqa: F401  (a hard requirement of this module, as in TRL)

from ...trainer.tool_calling import ToolCallRecord, _accepted_kwargs
from ._backends import GenerationBackend
from ._conversation import ConversationResult, ToolRuntime
from ._reconcile import TurnRecord, _common_prefix_len
from .async_rollout_worker import AsyncRolloutWorker


__all__ = ["CaptureContractError", "HarnessRolloutOutcome", "HarnessRolloutWorker"]

DEFAULT_MAX_TURNS = 8
HARNESS_REWARD = "harness_reward"


class CaptureContractError(ValueError):
    """A harness turn could not be captured losslessly as token ids (the rendered prompt does not extend the held
    tokens)."""


@dataclass
class HarnessRolloutOutcome:
    """What one harness rollout produced: its reward, completion messages, trace and tool-call counts.

    Attributes:
        env_reward: The reward the environment produced (None: none; the rollout is then unscored unless
            `rollout_reward_fn` gives one).
        completion: The messages after the prompt (assistant turns, tool results).
        trace: The harness's trace: tool-call entries (OpenEnv `ToolTraceEntry`) and, for harnesses that sample
            outside TRL, one entry per model turn with `prompt_ids`, `completion_ids` and `logprobs`.
        tool_call_count: Tool calls made.
        tool_failure_count: Tool calls that failed.
        tool_calls_by_name: Tool calls per tool name.
        timed_out: Whether the rollout stopped at a limit (turn cap, tool-call budget) rather than finishing.
    """

    env_reward: float | None
    completion: list[dict[str, Any]]
    trace: list[Any] = field(default_factory=list)
    tool_call_count: int = 0
    tool_failure_count: int = 0
    tool_calls_by_name: dict[str, int] = field(default_factory=dict)
    timed_out: bool = False


class _TurnCapReached(Exception):
    """Raised by `model_step` when a harness asks for a turn past the cap; ends the rollout (counted exhausted)."""


class _Stopped(Exception):
    """Raised by `model_step` when the worker stops; the rollout is abandoned."""


@dataclass
class _HarnessConversation(ConversationResult):
    """A finished harness rollout: the multi-turn worker's record plus the outcome and its `harness_reward`."""

    outcome: HarnessRolloutOutcome | None = None
    harness_reward: float | None = None


def _field(item: Any, name: str, default: Any = None) -> Any:
    """An attribute of an object or a key of a dict (harness traces and tool lists come as either)."""
    return item.get(name, default) if isinstance(item, dict) else getattr(item, name, default)


def _tool_schema(tool: Any) -> dict[str, Any]:
    """The chat-template schema of a session tool: an OpenEnv/MCP `Tool` (`name`, `description`, `input_schema`), an
    MCP-style dict (`inputSchema`), or a schema already in the `{"type": "function", ...}` shape."""
    if isinstance(tool, dict) and tool.get("type") == "function":
        return tool
    parameters = _field(tool, "input_schema") or _field(tool, "inputSchema") or _field(tool, "parameters")
    return {
        "type": "function",
        "function": {
            "name": _field(tool, "name"),
            "description": _field(tool, "description") or "",
            "parameters": parameters or {"type": "object", "properties": {}},
        },
    }


def _model_step_result(message: dict[str, Any], turn: TurnRecord) -> Any:
    """OpenEnv's `ModelStepResult` of a sampled turn: the parsed response (content, tool calls) and its tokens."""
    # Imported here: `openenv.core.harness` pulls in OpenEnv's server stack, which only the harness path needs.
    from openenv.core.harness import ModelStepResult
    from openenv.core.llm_client import LLMResponse, ToolCall

    calls = [
        ToolCall(
            id=call.get("id") or f"call_{index}",
            name=call["function"]["name"],
            args=dict(call["function"].get("arguments") or {}),
        )
        for index, call in enumerate(message.get("tool_calls") or [])
    ]
    return ModelStepResult(
        response=LLMResponse(content=message.get("content") or "", tool_calls=calls),
        prompt_ids=list(turn.prompt_ids),
        completion_ids=list(turn.output_ids),
        logprobs=list(turn.output_log_probs),
    )


def _reported_turns(trace: list[Any]) -> list[TurnRecord]:
    """The model turns a harness that samples outside TRL reports in its trace (entries with token ids)."""
    turns = []
    for entry in trace:
        prompt_ids, completion_ids = _field(entry, "prompt_ids"), _field(entry, "completion_ids")
        if prompt_ids is not None and completion_ids is not None:
            turns.append(TurnRecord(list(prompt_ids), list(completion_ids), list(_field(entry, "logprobs") or [])))
    return turns


def _trace_reward(trace: list[Any]) -> float | None:
    """The reward the environment put in the last tool result that has one (OpenEnv: `metadata` or `data`)."""
    for entry in reversed(trace):
        result = _field(entry, "result")
        if result is None:
            continue
        reward = (_field(result, "metadata") or {}).get("reward")
        data = _field(result, "data")
        if reward is None and isinstance(data, dict):
            reward = data.get("reward")
        if reward is not None:
            return float(reward)
    return None


def _tool_records(outcome: HarnessRolloutOutcome) -> list[ToolCallRecord]:
    """One record per tool call of an outcome, so that the worker's tool metrics count them: calls per name, failures
    attributed to a name where the trace says which call failed, the rest in call order; calls that the outcome
    counts but does not name are counted as unknown names."""
    failed_by_name = Counter(
        _field(entry, "tool_name")
        for entry in outcome.trace
        if _field(entry, "tool_name") and _field(_field(entry, "result"), "error") is not None
    )
    records = []
    for name, count in outcome.tool_calls_by_name.items():
        failures = min(failed_by_name.get(name, 0), count)
        records += [ToolCallRecord(name, index < failures, False, None) for index in range(count)]
    records += [ToolCallRecord("", False, True, None) for _ in range(outcome.tool_call_count - len(records))]
    unattributed = outcome.tool_failure_count - sum(record.failed for record in records)
    for record in records:
        if unattributed <= 0:
            break
        if not record.failed:
            record.failed, unattributed = True, unattributed - 1
    return records


class _TurnCapture:
    """TRL's sampler as a harness's model step, recording every turn of one rollout as token ids.

    Args:
        runtime: Renders conversations and samples/parses turns.
        backend: The generation backend.
        sampling_fn: The trainer's sampler settings for the next turn (read per turn: the served adapter may change).
        stop: The worker's stop event.
        on_turn: Called after each sampled turn (the worker's heartbeat).
        max_turns: Turns allowed; the next request raises `_TurnCapReached`.
        lossless: Whether a turn whose prompt does not extend the held tokens raises [`CaptureContractError`].
    """

    def __init__(
        self,
        runtime: ToolRuntime,
        backend: GenerationBackend,
        sampling_fn: Callable[[], dict[str, Any]],
        stop: threading.Event,
        on_turn: Callable[[], None],
        max_turns: int,
        lossless: bool,
    ):
        self.runtime, self.backend, self.sampling_fn = runtime, backend, sampling_fn
        self.stop, self.on_turn, self.max_turns, self.lossless = stop, on_turn, max_turns, lossless
        self.prompt: list[dict[str, Any]] | None = None
        self.messages: list[dict[str, Any]] = []
        self.tool_names: list[str] = []
        self.turns: list[TurnRecord] = []
        self.generate_s = 0.0
        self.capped = False

    def __call__(self, messages: list[dict[str, Any]], tools: list[Any] | None = None, sampling: Any = None) -> Any:
        """OpenEnv's `ModelStep`: sample the next assistant turn of `messages` (a `ModelStepResult`)."""
        if self.stop.is_set():
            raise _Stopped()
        if len(self.turns) >= self.max_turns:
            self.capped = True
            raise _TurnCapReached(f"the harness asked for turn {len(self.turns) + 1} of at most {self.max_turns}")
        schemas = [_tool_schema(tool) for tool in tools or []]
        messages = copy.deepcopy(list(messages))
        if self.prompt is None:
            self.prompt = copy.deepcopy(messages)
            self.tool_names = [schema["function"]["name"] for schema in schemas]
        prompt_ids = self.runtime.render(messages, schemas)
        self.check(prompt_ids)  # before sampling: a violating turn costs no generation
        turn, message, seconds = self.runtime.sample_turn(prompt_ids, schemas, self.backend, self.sampling_fn())
        self.generate_s += seconds
        self.turns.append(turn)
        self.messages = [*messages, message]
        self.on_turn()
        return _model_step_result(message, turn)

    def check(self, prompt_ids: list[int]) -> None:
        """Refuse (with lossless capture) a prompt that does not extend the tokens held for the rollout: the last
        turn's prompt and output."""
        if not self.lossless or not self.turns:
            return
        held = self.turns[-1].prompt_ids + self.turns[-1].output_ids
        matched = _common_prefix_len(held, prompt_ids)
        if matched < len(held):
            raise CaptureContractError(
                f"Turn {len(self.turns) + 1} of a harness rollout cannot be captured losslessly as token ids: its "
                f"rendered prompt ({len(prompt_ids)} tokens) departs from the {len(held)} tokens held for the rollout "
                f"at position {matched}. The harness rewrote earlier messages, or the chat template does not "
                "re-render the sampled turn as the same tokens. Keep the transcript append-only, or pass "
                "lossless_capture=False to reconcile such turns (a short tail is realigned, otherwise a new training "
                "row is forked)."
            )

    def add_reported(self, turns: list[TurnRecord]) -> None:
        """Record the turns a harness sampled itself (from its trace), under the same checks and cap."""
        if len(turns) > self.max_turns:
            turns, self.capped = turns[: self.max_turns], True
        for turn in turns:
            self.check(turn.prompt_ids)
            self.turns.append(turn)


class HarnessRolloutWorker(AsyncRolloutWorker):
    """Rollout worker driving an OpenEnv harness session per rollout (see the module docstring for both modes).

    Inject it with `AsyncGRPOTrainer(..., rollout_worker=HarnessRolloutWorker(...))`. Every rollout is one session;
    `num_generations` sessions of a dataset row form a group, scored by the reward functions plus the `harness_reward`
    column. Tools come from the sessions, so `tools`/`environment_factory` are refused.

    Args:
        harness_session_factory: Loop-owning mode: a callable returning a session with `run() ->`
            [`HarnessRolloutOutcome`] (and optionally `close()`), called with the keywords it accepts among `task`
            (a copy of the dataset row), `sampling` (the trainer's sampler settings), `model_step` and `max_turns`.
            Adapter mode: an OpenEnv `ResourceSessionFactory` (`create(task=row)`) or a callable `(task=row)`
            returning a `ResourceSession`.
        harness_adapter: An OpenEnv white-box `HarnessAdapter` (`run_white_box(model_step, session, limits)`); None
            for loop-owning mode.
        rollout_reward_fn: Maps a [`HarnessRolloutOutcome`] to the `harness_reward` value (None → unscored); by
            default the outcome's `env_reward`.
        lossless_capture: Raise [`CaptureContractError`] when a turn's rendered prompt does not extend the tokens held
            for the rollout (or a rollout has no captured turn); False reconciles such turns like the tool loop does.
        **kwargs: [`AsyncRolloutWorker`]'s arguments (`backend`, `dataset`, `tokenizer`, `reward_funcs`, ...).
            `max_tool_calling_iterations` sets the turn cap to its value + 1 (default cap: 8 turns).

    Raises:
        TypeError: For a missing or unusable `harness_session_factory`, `harness_adapter` or `rollout_reward_fn`.
        ValueError: With `tools` or `environment_factory`.
    """

    def __init__(
        self,
        *,
        harness_session_factory: Any = None,
        harness_adapter: Any = None,
        rollout_reward_fn: Callable[[HarnessRolloutOutcome], float | None] | None = None,
        lossless_capture: bool = True,
        **kwargs: Any,
    ):
        if harness_session_factory is None or not (
            callable(harness_session_factory) or callable(getattr(harness_session_factory, "create", None))
        ):
            raise TypeError(
                "HarnessRolloutWorker needs `harness_session_factory=`: without `harness_adapter`, a callable "
                "returning a session whose `run()` returns a HarnessRolloutOutcome (called with the keywords it "
                "accepts among `task`, `sampling`, `model_step`, `max_turns`); with `harness_adapter`, an OpenEnv "
                f"ResourceSessionFactory (`create(task=...)`) or a callable `(task=...)`; got {harness_session_factory!r}."
            )
        if harness_adapter is not None and not callable(getattr(harness_adapter, "run_white_box", None)):
            raise TypeError(
                "`harness_adapter` must be an OpenEnv white-box HarnessAdapter with `run_white_box(model_step, "
                f"session, limits)` (e.g. MCPHarnessAdapter), or None for loop-owning mode; got {harness_adapter!r}."
            )
        if rollout_reward_fn is not None and not callable(rollout_reward_fn):
            raise TypeError(
                "`rollout_reward_fn` must map a HarnessRolloutOutcome to a float (or None); got "
                f"{rollout_reward_fn!r}."
            )
        if kwargs.get("tools") or kwargs.get("environment_factory") is not None:
            raise ValueError(
                "HarnessRolloutWorker takes its tools from the harness sessions; drop `tools=` and "
                "`environment_factory=` (or use AsyncRolloutWorker for them)."
            )
        if kwargs.get("tokenizer") is None:
            raise TypeError("HarnessRolloutWorker needs `tokenizer=`, the policy's tokenizer (to render turns).")
        super().__init__(
            harness_session_factory=harness_session_factory,
            harness_adapter=harness_adapter,
            rollout_reward_fn=rollout_reward_fn,
            lossless_capture=lossless_capture,
            **kwargs,
        )
        # Every rollout is a multi-turn conversation: the runtime (no tools of its own) renders and parses the turns,
        # and its presence routes the loop through the shared multi-turn scheduler.
        self._tool_runtime = ToolRuntime(kwargs["tokenizer"], chat_template_kwargs=kwargs.get("chat_template_kwargs"))
        iterations = kwargs.get("max_tool_calling_iterations")
        self.max_turns = DEFAULT_MAX_TURNS if iterations is None else int(iterations) + 1

    # -- hooks of the multi-turn loop --------------------------------------------------------------------------------

    def _run_conversation(
        self,
        row: dict[str, Any],
        backend: GenerationBackend,
        sampling_fn: Callable[[], dict[str, Any]],
        stop: threading.Event,
        on_turn: Callable[[], None],
    ) -> _HarnessConversation | None:
        """Run one harness rollout of `row` (None when the worker stopped meanwhile)."""
        kwargs = self.loop_kwargs
        capture = _TurnCapture(
            self._tool_runtime, backend, sampling_fn, stop, on_turn, self.max_turns, kwargs["lossless_capture"]
        )
        task = copy.deepcopy(row)  # the harness may keep or change it; the row serves the group's other rollouts
        try:
            if kwargs["harness_adapter"] is None:
                outcome = self._run_loop_owning(task, capture)
            else:
                outcome = self._run_with_adapter(task, capture)
        except _Stopped:
            return None
        if capture.lossless and not capture.turns:
            raise CaptureContractError(
                "A harness rollout produced no turn TRL could train on: sample turns through `model_step`, or report "
                "each turn's `prompt_ids`/`completion_ids`/`logprobs` in the outcome's trace."
            )
        result = _HarnessConversation(
            prompt=capture.prompt if capture.prompt is not None else copy.deepcopy(task.get("prompt") or []),
            completion=list(outcome.completion),
            turns=capture.turns,
            completion_ids=[token for turn in capture.turns for token in turn.output_ids],
            tool_records=_tool_records(outcome),
            exhausted=capture.capped,
            tool_names=list(dict.fromkeys([*capture.tool_names, *outcome.tool_calls_by_name])),
            generate_s=capture.generate_s,
            outcome=outcome,
        )
        reward_fn = kwargs["rollout_reward_fn"]
        result.harness_reward = reward_fn(outcome) if reward_fn is not None else outcome.env_reward
        return result

    def _run_loop_owning(self, task: dict[str, Any], capture: _TurnCapture) -> HarnessRolloutOutcome:
        factory = self.loop_kwargs["harness_session_factory"]
        offered = {"task": task, "sampling": capture.sampling_fn(), "model_step": capture, "max_turns": self.max_turns}
        session = factory(**_accepted_kwargs(factory, offered))
        try:
            outcome = session.run()
        except _TurnCapReached:
            outcome = HarnessRolloutOutcome(None, capture.messages[len(capture.prompt or []) :], timed_out=True)
        finally:
            close = getattr(session, "close", None)
            if callable(close):
                close()
        if not isinstance(outcome, HarnessRolloutOutcome):
            raise TypeError(
                f"The harness session's run() must return a HarnessRolloutOutcome; got {type(outcome).__name__}."
            )
        if not capture.turns:  # the harness sampled outside TRL: its trace carries the turns
            capture.add_reported(_reported_turns(outcome.trace))
        return outcome

    def _run_with_adapter(self, task: dict[str, Any], capture: _TurnCapture) -> HarnessRolloutOutcome:
        from openenv.core.harness import HarnessRunLimits

        factory = self.loop_kwargs["harness_session_factory"]
        create = getattr(factory, "create", None)
        session = create(task=task) if callable(create) else factory(**_accepted_kwargs(factory, {"task": task}))
        try:
            limits = HarnessRunLimits(max_turns=self.max_turns, sampling=dict(capture.sampling_fn()))
            try:
                rollout = self.loop_kwargs["harness_adapter"].run_white_box(capture, session, limits)
                messages, trace, done = list(rollout.messages), list(rollout.tool_trace), bool(rollout.done)
                metrics = dict(rollout.metrics)
            except _TurnCapReached:  # an adapter that ignores `limits.max_turns`
                messages, trace, done, metrics = list(capture.messages), [], False, {}
            verify = session.verify(messages, final_state={"done": done, "metrics": metrics, "tool_trace": trace})
        finally:
            session.close()
        env_reward = verify.env_reward if verify.env_reward is not None else _trace_reward(trace)
        return HarnessRolloutOutcome(
            env_reward=None if env_reward is None else float(env_reward),
            completion=messages[len(capture.prompt or []) :],
            trace=trace,
            tool_call_count=len(trace),
            tool_failure_count=sum(_field(_field(entry, "result"), "error") is not None for entry in trace),
            tool_calls_by_name=dict(Counter(_field(entry, "tool_name") for entry in trace)),
            timed_out=not done,
        )

    def _release(self, result: ConversationResult) -> None:
        pass  # sessions are closed when their rollout ends

    def _extra_reward_columns(
        self, results: list[ConversationResult]
    ) -> tuple[list[tuple[str, list[Any]]], dict[str, float]]:
        """The `harness_reward` column, and `rollout/correctness_mean`: the mean environment reward of the group's
        rollouts that have one (the fraction solved for 0/1 rewards; NaN, dropped when logging, when none has)."""
        env_rewards = [result.outcome.env_reward for result in results if result.outcome.env_reward is not None]
        correctness = float(np.mean(env_rewards)) if env_rewards else math.nan
        return [(HARNESS_REWARD, [result.harness_reward for result in results])], {
            "rollout/correctness_mean": correctness
        }

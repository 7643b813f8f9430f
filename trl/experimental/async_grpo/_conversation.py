"""Multi-turn conversations of the rollout worker: tools, environments, the turn loop and its metrics.

A conversation starts from a dataset row. With `environment_factory`, the row gets a pooled environment instance:
`reset(**row)` (the `environment` column left out with a dict of factories) may return an observation, appended to
the last prompt message, and the instance's public methods become tools next to the trainer-wide `tools`. Each turn
re-renders the **whole** message list with the chat template (tool schemas, generation prompt,
`chat_template_kwargs`), samples one completion (`n=1`), parses it into an assistant message (`parse_response`) and
runs its tool calls; the tool results are appended as `tool` messages and the next turn is generated, until a turn
calls no tool or `max_tool_calling_iterations` rounds of tool calls have run (the loop is then "exhausted": the last
turn's calls are not executed). Every turn is kept as a [`TurnRecord`]; `_chain_to_sequences` turns them into
training rows (tool results and turn markers are untrained context).

The tool and environment helpers are GRPO's (`trl.trainer.tool_calling`), so both trainers validate, describe and run
tools the same way.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving, parse_response
from ...trainer.tool_calling import (
    ToolCallRecord,
    _accepted_kwargs,
    _environment_reward,
    _EnvironmentPool,
    ensure_response_parser,
    environment_placeholder_dataset,
    environment_reward_classes,
    environment_tools,
    execute_tool_calls,
    require_conversational_prompts,
    require_response_parser_support,
    require_tool_calling_template,
    tool_schema,
    validate_tools,
)
from ...trainer.utils import get_callable_name
from ._backends import GenerationBackend
from ._reconcile import TurnRecord


@dataclass
class ConversationResult:
    """One finished conversation.

    Attributes:
        prompt: The prompt messages (with the environment's reset observation appended).
        completion: The assistant and tool messages after the prompt.
        turns: One [`TurnRecord`] per generated turn.
        completion_ids: The tokens the model generated, every turn concatenated.
        tool_records: One record per tool call.
        parallel_calls: Per turn that called tools, how many calls it made.
        exhausted: Whether the loop stopped at `max_tool_calling_iterations` with tool calls left unexecuted.
        tool_names: The tools this conversation could call.
        environment: Its environment instance (None without environments); held until the group is scored.
        environment_name: The factory the instance came from (None with a single factory).
        reset_s: Seconds `reset()` took (None without environments).
        generate_s: Seconds spent waiting on the generation backend.
    """

    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    tool_records: list[ToolCallRecord] = field(default_factory=list)
    parallel_calls: list[int] = field(default_factory=list)
    exhausted: bool = False
    tool_names: list[str] = field(default_factory=list)
    environment: Any = None
    environment_name: Any = None
    reset_s: float | None = None
    generate_s: float = 0.0


def _append_observation(prompt: list[dict[str, Any]], observation: Any) -> None:
    """Append an environment's reset observation (text or a list of content blocks) to the last prompt message."""
    if not prompt:
        prompt.append({"role": "user", "content": observation if isinstance(observation, list) else str(observation)})
        return
    message = prompt[-1]
    content = message.get("content")
    if isinstance(observation, list):
        blocks = (
            list(content) if isinstance(content, list) else ([{"type": "text", "text": content}] if content else [])
        )
        message["content"] = blocks + list(observation)
    elif isinstance(content, list):
        message["content"] = [*content, {"type": "text", "text": str(observation)}]
    else:
        message["content"] = (content or "") + str(observation)


def prepare_tool_tokenizer(tokenizer: Any) -> str | None:
    """Check that the tokenizer can render tools and parse tool calls (giving it TRL's response parser when it has
    none) and return the chat template to render conversations with: None for its own, or TRL's training variant when
    its own is not prefix-preserving.

    Raises:
        ValueError: If the template cannot render tools, or no response parser or training variant exists for it.
    """
    require_tool_calling_template(tokenizer)
    ensure_response_parser(tokenizer)
    # Each turn re-renders the whole conversation: with a template that rewrites earlier turns (e.g. drops past
    # reasoning), TRL renders with its training variant so that the turns extend each other.
    return None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)


def prepare_tool_setup(
    tools: list[Callable] | None,
    environment_factory: Callable | dict[str, Callable] | None,
    args: Any,
    train_dataset: Any,
) -> tuple[list[Callable], _EnvironmentPool | None, Any]:
    """Validate AsyncGRPO's `tools` / `environment_factory` against its dataset before anything is loaded.

    Without a `prompt` column (or without a dataset), a single `environment_factory` and `max_steps > 0` give every
    row an empty user prompt that `reset()` fills in (no dataset: `per_device_train_batch_size ·
    gradient_accumulation_steps` rows).

    Returns:
        `(tools, pool, train_dataset)`: the validated tools, the probed environment pool (None without environments)
        and the dataset to train on.

    Raises:
        ValueError: For tools that cannot be described, environments without `reset`, a dict `environment_factory`
            whose rows do not name one of its environments, or prompts that are missing or not conversational.
    """
    if not tools and environment_factory is None:
        return [], None, train_dataset
    require_response_parser_support()
    tools = validate_tools(tools)
    pool = _EnvironmentPool(environment_factory) if environment_factory is not None else None
    columns = list(train_dataset.column_names or []) if train_dataset is not None else []
    if pool is not None and "prompt" not in columns:
        if train_dataset is None:
            rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
            train_dataset = environment_placeholder_dataset(pool, args, rows)
        elif pool.by_column:
            raise ValueError(
                f"train_dataset has no 'prompt' column (its columns: {columns}). Prompts may be left out only with a "
                "single environment_factory (reset() then writes them), not with a dict of factories: add a "
                "'prompt' column of chat messages."
            )
        else:
            prompts = environment_placeholder_dataset(pool, args, len(train_dataset))["prompt"]
            train_dataset = train_dataset.add_column("prompt", prompts)
    if pool is not None and pool.by_column:
        names = sorted(pool.factories)
        if "environment" not in train_dataset.column_names:
            raise ValueError(
                f"With a dict environment_factory (environments {names}), every row of train_dataset must name its "
                f"environment in an 'environment' column; the dataset has the columns {train_dataset.column_names}. "
                "Add one, e.g. `dataset.add_column('environment', [...])`, or pass a single factory."
            )
        unknown = sorted({str(name) for name in train_dataset["environment"] if name not in pool.factories})
        if unknown:
            raise ValueError(
                f"The 'environment' column names {unknown}, which environment_factory does not define (it has "
                f"{names}). Fix the column or add these names to the environment_factory dict."
            )
    require_conversational_prompts(train_dataset)
    return tools, pool, train_dataset


class ToolRuntime:
    """The tools, environments and tokenizer of the multi-turn rollouts, shared by the worker's conversation threads.

    Args:
        tokenizer: The policy's tokenizer; it gets a response parser (`add_response_schema`) when it has none.
        tools: Trainer-wide tools (sync or async callables with type hints and a Google-style docstring).
        environment_factory: A callable returning an environment, a dict name → callable (rows then name theirs in
            an `environment` column), or an `_EnvironmentPool` built from one (probed already).
        chat_template_kwargs: Extra keyword arguments of `apply_chat_template`.
        max_tool_calling_iterations: Rounds of tool calls per conversation (None: no limit).

    Raises:
        ValueError: When a tool cannot be described, an environment has no `reset`, or the tokenizer cannot render
            tools or parse tool calls.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: list[Callable] | None = None,
        environment_factory: Callable | dict[str, Callable] | _EnvironmentPool | None = None,
        chat_template_kwargs: dict | None = None,
        max_tool_calling_iterations: int | None = None,
    ):
        require_response_parser_support()
        self.tokenizer = tokenizer
        self.tools = validate_tools(tools)
        self.tool_schemas = [tool_schema(tool) for tool in self.tools]
        if environment_factory is None or isinstance(environment_factory, _EnvironmentPool):
            self.pool = environment_factory
        else:
            self.pool = _EnvironmentPool(environment_factory)
        self.reward_classes = environment_reward_classes(self.pool) if self.pool is not None else []
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.chat_template_kwargs.pop("add_generation_prompt", None)
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.chat_template = prepare_tool_tokenizer(tokenizer)
        # Fast tokenizers are not safe to call from several threads at once ("Already borrowed").
        self._tokenizer_lock = threading.Lock()

    @property
    def reward_names(self) -> list[str]:
        """Names of the environment reward columns (one per environment class with `get_reward`)."""
        return [klass.__name__ for klass in self.reward_classes]

    def render(self, messages: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> list[int]:
        """Token ids of the whole conversation with the generation prompt, as the chat template renders it."""
        kwargs = dict(self.chat_template_kwargs)
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        with self._tokenizer_lock:
            text = self.tokenizer.apply_chat_template(
                messages, tools=schemas or None, tokenize=False, add_generation_prompt=True, **kwargs
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def sample_turn(
        self,
        prompt_ids: list[int],
        schemas: list[dict[str, Any]],
        backend: GenerationBackend,
        sampling: dict[str, Any],
    ) -> tuple[TurnRecord, dict[str, Any], float]:
        """Sample one turn (`n=1`) of a rendered conversation and parse it into an assistant message.

        Returns:
            `(turn, message, seconds)`: the turn's record, the parsed message and the seconds spent generating.
        """
        start = time.perf_counter()
        ((output_ids, log_probs),) = backend.generate(prompt_ids, 1, sampling)
        seconds = time.perf_counter() - start
        turn = TurnRecord(list(prompt_ids), list(output_ids), list(log_probs))
        with self._tokenizer_lock:
            message = parse_response(self.tokenizer, turn.output_ids, prefix=turn.prompt_ids, tools=schemas)
        return turn, message, seconds

    def _start(self, row: dict[str, Any]) -> ConversationResult:
        """A new conversation of `row`: its environment taken from the pool and reset, its tools listed."""
        result = ConversationResult(prompt=copy.deepcopy(row["prompt"]))
        if self.pool is not None:
            name, environment = self.pool.checkout(row)
            result.environment, result.environment_name = environment, name
            # A copy: an environment may keep or change what it is given, the row serves the group's other conversations.
            columns = {
                key: copy.deepcopy(value)
                for key, value in row.items()
                if not (self.pool.by_column and key == "environment")
            }
            start = time.perf_counter()
            observation = environment.reset(**_accepted_kwargs(environment.reset, columns))
            result.reset_s = time.perf_counter() - start
            if observation is not None:
                _append_observation(result.prompt, observation)
        return result

    def release(self, result: ConversationResult) -> None:
        """Hand the conversation's environment back to the pool (after its group was scored)."""
        if self.pool is not None and result.environment is not None:
            self.pool.release(result.environment_name, result.environment)
            result.environment = None

    def run(
        self,
        row: dict[str, Any],
        backend: GenerationBackend,
        sampling_fn: Callable[[], dict[str, Any]],
        stop: threading.Event,
        on_turn: Callable[[], None] | None = None,
    ) -> ConversationResult | None:
        """Run one conversation of `row` to its end.

        Args:
            row: The dataset row (`prompt` and the other columns).
            backend: Where turns are sampled (`n=1` each).
            sampling_fn: The sampling settings of the next turn (read per turn: the served adapter may change).
            stop: Set when the worker stops; the conversation is then abandoned (None).
            on_turn: Called after each generated turn (the worker's heartbeat).

        Returns:
            The finished conversation (its environment still held, see `release`), or None when stopped.
        """
        result = self._start(row)
        try:
            callables = list(self.tools)
            schemas = list(self.tool_schemas)
            if result.environment is not None:
                methods = environment_tools(result.environment)
                callables += methods
                schemas += [tool_schema(method) for method in methods]
            mapping = {get_callable_name(func): func for func in callables}
            result.tool_names = list(mapping)
            rounds = 0
            while True:
                if stop.is_set():
                    self.release(result)
                    return None
                prompt_ids = self.render(result.prompt + result.completion, schemas)
                turn, message, seconds = self.sample_turn(prompt_ids, schemas, backend, sampling_fn())
                result.generate_s += seconds
                if on_turn is not None:
                    on_turn()
                result.turns.append(turn)
                result.completion_ids += turn.output_ids
                result.completion.append(message)
                calls = message.get("tool_calls")
                if not calls:
                    break
                if self.max_tool_calling_iterations is not None and rounds >= self.max_tool_calling_iterations:
                    result.exhausted = True
                    break
                # TRL's tool message content is `str(result)` (errors: the `{"error": ...}` dict as text).
                (tool_messages,), records = execute_tool_calls([calls], [mapping], format_result=str)
                result.completion += tool_messages
                result.tool_records += records
                result.parallel_calls.append(len(calls))
                rounds += 1
        except BaseException:
            self.release(result)
            raise
        return result

    def environment_rewards(self, results: list[ConversationResult]) -> tuple[list[list[Any]], float]:
        """The environment reward columns of a group (`get_reward()` of each conversation's environment of that
        class, None for other classes) and the seconds they took."""
        start = time.perf_counter()
        environments = [result.environment for result in results]
        columns = [
            _environment_reward(klass.__name__, klass)(environments=environments) for klass in self.reward_classes
        ]
        return columns, time.perf_counter() - start


def group_metrics(
    results: list[ConversationResult], drift_stats: list[dict[str, float]], max_completion_length: int
) -> dict[str, float]:
    """The worker's per-group metrics of multi-turn rollouts (TRL's keys): turns, drift between turns, tool calls,
    tool latencies, loop exhaustion, environment reset time and completion lengths."""
    num = max(len(results), 1)
    turns = [len(result.turns) for result in results]
    transitions = sum(stats["transitions"] for stats in drift_stats)
    metrics: dict[str, float] = {
        "rollout/turns_mean": float(np.mean(turns)) if turns else 0.0,
        "rollout/turns_max": float(max(turns, default=0)),
        "rollout/fork_frac": sum(stats["fork"] for stats in drift_stats) / transitions if transitions else 0.0,
        "rollout/realign_frac": sum(stats["realign"] for stats in drift_stats) / transitions if transitions else 0.0,
        "rollout/drift_tokens_mean": sum(stats["drift_tokens"] for stats in drift_stats) / transitions
        if transitions
        else 0.0,
        "rollout/drift_tokens_max": float(max((stats["drift_max"] for stats in drift_stats), default=0.0)),
        "tools/loop_exhausted_frac": sum(result.exhausted for result in results) / num,
    }
    lengths = [len(result.completion_ids) for result in results]
    clipped = [bool(result.turns) and len(result.turns[-1].output_ids) >= max_completion_length for result in results]
    metrics.update(
        {
            "completions/mean_length": float(np.mean(lengths)) if lengths else 0.0,
            "completions/max_length": float(max(lengths, default=0)),
            "completions/min_length": float(min(lengths, default=0)),
            "completions/clipped_ratio": float(np.mean(clipped)) if clipped else 0.0,
        }
    )
    calls: dict[str, float] = defaultdict(float)
    failures: dict[str, float] = defaultdict(float)
    latencies: dict[str, list[float]] = defaultdict(list)
    for result in results:
        for name in result.tool_names:
            calls[name] += 0.0
            failures[name] += 0.0
    unknown = 0
    for record in (record for result in results for record in result.tool_records):
        if record.unknown:
            unknown += 1
            continue
        calls[record.name] += 1
        failures[record.name] += record.failed
        if record.latency_s is not None:
            latencies[record.name].append(record.latency_s)
    for name in calls:
        metrics[f"tools/{name}/call_total"] = calls[name]
        metrics[f"tools/{name}/failure_total"] = failures[name]
    metrics["tools/unknown_name_total"] = float(unknown)
    all_latencies = [value for values in latencies.values() for value in values]
    if all_latencies:
        metrics["tools/latency_s"] = float(np.mean(all_latencies))
        for name, values in latencies.items():
            metrics[f"tools/{name}/latency_s"] = float(np.mean(values))
    parallel = [count for result in results for count in result.parallel_calls]
    if parallel:
        metrics["tools/parallel_calls_mean"] = float(np.mean(parallel))
    resets = [result.reset_s for result in results if result.reset_s is not None]
    if resets:
        metrics["env/reset_s"] = float(np.mean(resets))
    return metrics


def tool_frequencies(results: list[ConversationResult]) -> dict[str, float]:
    """The per-sample `tools/call_frequency` (calls per conversation) and `tools/failure_frequency` (failed calls per
    call) of a group that called tools; empty when it called none."""
    calls = sum(len(result.tool_records) for result in results)
    if not calls:
        return {}
    failures = sum(record.failed for result in results for record in result.tool_records)
    return {"tools/call_frequency": calls / max(len(results), 1), "tools/failure_frequency": failures / calls}

"""Multi-turn tool calling and environments for the online trainers.

The tool loop sits above the trainer's single-turn generation hook (`_generate_single_turn`, TRL's), so it works with
every generation backend (transformers `generate`, continuous batching, vLLM). One rollout goes:

1. (environments) each generated row gets its own environment instance; `reset(**row)` may extend the last user
   message, and the instance's public methods become that row's tools, next to the trainer-wide `tools`;
2. the prompts are rendered with the tool schemas (chat template) and a first turn is generated;
3. each finished turn is parsed into an assistant message (`parse_response`); its tool calls are executed (sync or
   async functions; an exception, an unknown tool or bad arguments give a tool message with the error text and count
   as a failure), and the text the chat template puts between the end of that turn and the next assistant turn (tool
   results, turn markers) is tokenized and appended to the completion with `tool_mask = 0`;
4. the rows that called a tool are generated again from exactly the tokens so far, until no row calls a tool, the
   completion budget `max_completion_length` is spent (the completion is then truncated), or
   `max_tool_calling_iterations` rounds of tool execution have run.

The completion trained on is the concatenation of every turn; its tool-result tokens are attended to but excluded
from the loss. Reward functions receive the conversation (assistant messages with their `tool_calls`, `tool`
messages) as `completions`, and `environments` (one instance per row) when environments are used.

The module-level pieces (tool validation and schemas, environment discovery and pooling, tool execution, the
tokenizer checks) are also AsyncGRPO's (`trl/experimental/async_grpo/_conversation.py`), whose rollout worker runs
its own conversation loop (one re-rendered prompt per turn) on top of them.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from datasets import Dataset

from .._compat import response_content_parsers
from ..chat_template_utils import (
    add_response_schema,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)
from ..data_utils import is_conversational
from .online_rewards import _run_coroutines
from .utils import get_callable_name, is_async_callable


logger = logging.getLogger(__name__)

# Methods of an environment that are part of its protocol, never exposed as tools.
ENVIRONMENT_RESERVED_METHODS = ("reset", "get_reward")


# ---------------------------------------------------------------------------------------------------------------------
# Validation and tool discovery
# ---------------------------------------------------------------------------------------------------------------------
def tool_schema(tool: Callable, where: str = "tools") -> dict[str, Any]:
    """JSON schema of a tool function, built from its type hints and Google-style docstring.

    Raises:
        ValueError: If the function lacks type hints or a docstring describing it and its arguments.
    """
    from transformers.utils import get_json_schema

    if not callable(tool):
        raise ValueError(f"Every entry of {where} must be a callable; found {type(tool).__name__} ({tool!r}).")
    name = get_callable_name(tool)
    try:
        return get_json_schema(tool)
    except Exception as error:  # transformers raises its own parsing exceptions
        raise ValueError(
            f"Tool {name!r} (from {where}) cannot be described to the model: {error}. A tool needs a type hint on "
            "every argument and a Google-style docstring with a description and an `Args:` section documenting each "
            'argument, e.g.\n\n    def multiply(a: int, b: int) -> int:\n        """Multiply two integers.\n\n'
            '        Args:\n            a: First factor.\n            b: Second factor.\n        """'
        ) from error


def environment_tools(environment: Any) -> list[Callable]:
    """The public methods of an environment instance, bound to it, in definition order (reset/get_reward excluded)."""
    tools = []
    seen = set()
    for klass in type(environment).__mro__:
        if klass is object:
            continue
        for name, attribute in vars(klass).items():
            if name.startswith("_") or name in ENVIRONMENT_RESERVED_METHODS or name in seen:
                continue
            seen.add(name)
            if isinstance(attribute, (staticmethod, classmethod)) or inspect.isfunction(attribute):
                tools.append(getattr(environment, name))
    return tools


def _accepted_kwargs(func: Callable, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` that `func` accepts as keyword arguments (all of them with `**kwargs`)."""
    try:
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(values)
    return {key: value for key, value in values.items() if key in parameters}


def _result_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


class _EnvironmentPool:
    """Environment instances by factory name, reused across rollouts (row `k` of a rollout gets the `k`-th instance
    of its factory, re-initialised by `reset()`)."""

    def __init__(self, environment_factory: Callable | dict[str, Callable]):
        if isinstance(environment_factory, dict):
            if not environment_factory:
                raise ValueError("environment_factory is an empty dict; map at least one name to a factory.")
            self.factories = dict(environment_factory)
            self.by_column = True
        else:
            self.factories = {None: environment_factory}
            self.by_column = False
        self.instances: dict[Any, list[Any]] = {}
        # Instances not in use by a running conversation (`checkout`/`release`, used by concurrent rollouts).
        self._free: dict[Any, list[Any]] = {}
        self._lock = threading.Lock()
        for name, factory in self.factories.items():
            if not callable(factory):
                raise ValueError(
                    f"environment_factory{'' if name is None else f'[{name!r}]'} must be a callable returning an "
                    f"environment (e.g. the environment class); found {type(factory).__name__}."
                )
            probe = factory()  # built once here to validate its tools and name its reward
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(
                    f"The environment {type(probe).__name__} has no reset() method. An environment needs "
                    "`reset(**kwargs)` (returning None or text appended to the last user message); its public methods "
                    "become tools."
                )
            for tool in environment_tools(probe):
                tool_schema(tool, where=f"the methods of {type(probe).__name__}")
            self.instances[name] = [probe]

    def classes(self) -> dict[Any, type]:
        return {name: type(instances[0]) for name, instances in self.instances.items()}

    def factory_name(self, row: dict[str, Any]) -> Any:
        """The factory a row's environment comes from: its `environment` column with a dict factory, else None."""
        if not self.by_column:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ValueError(
                f"With a dict environment_factory, every row needs an 'environment' column naming one of "
                f"{sorted(self.factories)}; found {name!r}."
            )
        return name

    def acquire(self, inputs: list[dict[str, Any]]) -> list[Any]:
        used: dict[Any, int] = {}
        environments = []
        for row in inputs:
            name = self.factory_name(row)
            index = used.get(name, 0)
            used[name] = index + 1
            pool = self.instances[name]
            while len(pool) <= index:
                pool.append(self.factories[name]())
            environments.append(pool[index])
        return environments

    def checkout(self, row: dict[str, Any]) -> tuple[Any, Any]:
        """`(factory name, instance)` for a row, for as long as the caller holds it (thread-safe; concurrent
        conversations each get their own instance, built when every existing one is taken)."""
        name = self.factory_name(row)
        with self._lock:
            free = self._free.setdefault(name, list(self.instances[name]))
            if free:
                return name, free.pop()
        return name, self.factories[name]()

    def release(self, name: Any, environment: Any) -> None:
        """Hand an instance taken with `checkout` back for reuse (it is `reset()` before its next conversation)."""
        with self._lock:
            self._free.setdefault(name, []).append(environment)


def _environment_reward(name: str, klass: type) -> Callable:
    """Reward function calling `get_reward()` on each row's environment of class `klass` (None for other rows)."""

    def reward(environments: list[Any] | None = None, **kwargs: Any) -> list[float | None]:
        return [env.get_reward() if isinstance(env, klass) else None for env in environments or []]

    reward.__name__ = name
    reward.__qualname__ = name
    return reward


def environment_reward_classes(pool: _EnvironmentPool) -> list[type]:
    """The environment classes of `pool` that define `get_reward` (one reward column each, named after the class)."""
    classes: list[type] = []
    for klass in pool.classes().values():
        if callable(getattr(klass, "get_reward", None)) and klass.__name__ not in [k.__name__ for k in classes]:
            classes.append(klass)
    return classes


# ---------------------------------------------------------------------------------------------------------------------
# Checks shared by the trainers with tools (GRPO, Distillation, AsyncGRPO)
# ---------------------------------------------------------------------------------------------------------------------
def require_response_parser_support() -> None:
    """Raise `ImportError` when transformers cannot parse tool calls out of generated text."""
    if not response_content_parsers():
        raise ImportError(
            f"tools/environment_factory need transformers' response parser (`tokenizer.parse_response`, "
            f"transformers 5.0 and later) to read tool calls from generated text; transformers "
            f"{transformers.__version__} has none. Upgrade with `pip install 'transformers>=5'`."
        )


def validate_tools(tools: Any) -> list[Callable]:
    """`tools` as a list, after checking that each one can be described to the model and that names are unique.

    Raises:
        ValueError: If `tools` is not a list, a tool lacks type hints or a docstring, or two tools share a name.
    """
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ValueError(f"tools must be a list of functions; found {type(tools).__name__}.")
    tools = list(tools or [])
    names = []
    for tool in tools:
        names.append(tool_schema(tool)["function"]["name"])
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Several tools share the name(s) {duplicates}; tool names must be unique.")
    return tools


def require_conversational_prompts(train_dataset: Any) -> None:
    """Raise `ValueError` when the dataset's first prompt is not a list of chat messages (tools need the template)."""
    if isinstance(train_dataset, Dataset) and len(train_dataset) and "prompt" in train_dataset.column_names:
        first = train_dataset[0]["prompt"]
        if not is_conversational({"prompt": first}):
            raise ValueError(
                "Tool calling needs conversational prompts (lists of chat messages) so that tools and tool "
                f"results are rendered with the chat template; the train dataset's first prompt is a "
                f"{type(first).__name__}. Convert the prompts to e.g. [{{'role': 'user', 'content': ...}}]."
            )


def environment_placeholder_dataset(pool: _EnvironmentPool, args: Any, rows: int) -> Dataset:
    """The prompts of a run without a train dataset: `rows` empty user messages, which `reset()` fills in.

    Raises:
        ValueError: With a dict `environment_factory` (rows must name their environment) or without `max_steps > 0`.
    """
    if pool.by_column:
        raise ValueError(
            "A dict environment_factory needs a train_dataset with an 'environment' column choosing the "
            "environment of each row; pass one."
        )
    max_steps = getattr(args, "max_steps", -1) if args is not None else -1
    if max_steps is None or max_steps <= 0:
        raise ValueError(
            "Without a train_dataset the prompts come from the environments' reset(), and the run length "
            f"must be given by max_steps (> 0); found max_steps={max_steps}. Set max_steps in the config "
            "or pass a train_dataset."
        )
    # Every prompt is one empty user message; reset() supplies its text.
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * max(1, rows)})


def require_tool_calling_template(tokenizer: Any) -> None:
    """Raise `ValueError` when the tokenizer's chat template cannot render tools, tool calls and tool results."""
    if not supports_tool_calling(tokenizer):
        raise ValueError(
            f"The chat template of the {type(tokenizer).__name__} cannot render tools, tool calls and tool "
            "results, which tools/environment_factory need. Use a tokenizer whose template supports tool calling "
            "(e.g. `tokenizer.chat_template = trl.chat_template_utils.qwen2_5_chat_template`)."
        )


def ensure_response_parser(tokenizer: Any) -> None:
    """Give the tokenizer TRL's response parser for its template when it has none (`add_response_schema`).

    Raises:
        ValueError: If the tokenizer has no parser and TRL has none for its chat template.
    """
    has_parser = any(getattr(tokenizer, attr, None) for attr in ("response_template", "response_schema"))
    if not has_parser:
        try:
            add_response_schema(tokenizer)
        except ValueError as error:
            raise ValueError(
                "Tool calls are parsed from the completions with the tokenizer's response parser, which this "
                f"tokenizer lacks and TRL has none for its chat template ({error}). Set "
                "`tokenizer.response_template` (transformers' response parsing format) before creating the trainer."
            ) from error


# ---------------------------------------------------------------------------------------------------------------------
# Tool execution
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class ToolCallRecord:
    """What one tool call did: the tool's name, whether it failed (and whether the name was unknown) and how long it
    ran (None when it was not run: unknown name or arguments that are not a JSON object)."""

    name: str
    failed: bool
    unknown: bool
    latency_s: float | None


def execute_tool_calls(
    calls_per_row: list[list[dict[str, Any]]],
    tool_maps: list[dict[str, Callable]],
    format_result: Callable[[Any], str] = _result_text,
) -> tuple[list[list[dict[str, Any]]], list[ToolCallRecord]]:
    """Run the tool calls of several rows (async tools of every row concurrently) and build the tool messages.

    An unknown tool name, arguments that are not a JSON object, or an exception give the result
    `{"error": text}` and count as a failure: the model reads what went wrong instead of the run stopping.

    Args:
        calls_per_row: The `tool_calls` of each row's last assistant message.
        tool_maps: Per row, the callables by tool name.
        format_result: Turns a tool's return value (or the error dict) into the tool message's content.

    Returns:
        `(messages, records)`: per row, one `{"role": "tool", "name", "content"}` message per call (in call order),
        and one [`ToolCallRecord`] per call.
    """
    results: list[list[dict[str, Any] | None]] = []
    records: list[ToolCallRecord] = []
    coroutines: list[tuple[int, int, str, Any, int]] = []

    def message(name: str, value: Any) -> dict[str, Any]:
        return {"role": "tool", "name": name, "content": format_result(value)}

    for row, (tool_calls, mapping) in enumerate(zip(calls_per_row, tool_maps)):
        row_results: list[dict[str, Any] | None] = []
        for call in tool_calls:
            function = call.get("function", {})
            name = function.get("name")
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            func = mapping.get(name)
            if func is None or not isinstance(arguments, dict):
                text = (
                    f"Tool {name!r} does not exist; available tools: {sorted(mapping)}."
                    if func is None
                    else f"The arguments of {name!r} are not a JSON object: {function.get('arguments')!r}."
                )
                records.append(ToolCallRecord(str(name), True, func is None, None))
                row_results.append(message(str(name), {"error": text}))
                continue
            start = time.perf_counter()
            try:
                value = func(**arguments)
                if is_async_callable(func) or inspect.iscoroutine(value):
                    coroutines.append((row, len(row_results), name, value, len(records)))
                    records.append(ToolCallRecord(name, False, False, 0.0))
                    row_results.append(None)
                    continue
                records.append(ToolCallRecord(name, False, False, time.perf_counter() - start))
                row_results.append(message(name, value))
            except Exception as error:
                records.append(ToolCallRecord(name, True, False, time.perf_counter() - start))
                row_results.append(message(name, {"error": f"{type(error).__name__}: {error}"}))
        results.append(row_results)

    if coroutines:

        async def guarded(coroutine):
            start = time.perf_counter()
            try:
                return True, await coroutine, time.perf_counter() - start
            except Exception as error:
                return False, error, time.perf_counter() - start

        outcomes = _run_coroutines([guarded(coroutine) for *_, coroutine, _ in coroutines])
        for (row, position, name, _, index), (ok, value, latency) in zip(coroutines, outcomes):
            records[index].latency_s = latency
            if ok:
                results[row][position] = message(name, value)
            else:
                records[index].failed = True
                results[row][position] = message(name, {"error": f"{type(value).__name__}: {value}"})
    return results, records


# ---------------------------------------------------------------------------------------------------------------------
# The trainer mixin
# ---------------------------------------------------------------------------------------------------------------------
class _ToolCallingMixin:
    """Tool calling and environments for a trainer built on `_OnlineTrainer` (see the module docstring).

    Use: call `_prepare_tool_setup` before the base `__init__` (validation, environments, extra reward functions and
    the placeholder dataset) and `_init_tools` after it (tokenizer checks).
    """

    _tools_enabled = False

    @staticmethod
    def _prepare_tool_setup(
        tools: list[Callable] | None,
        environment_factory: Callable | dict[str, Callable] | None,
        reward_funcs: Any,
        args: Any,
        train_dataset: Any,
        rollout_func: Callable | None,
    ) -> dict[str, Any]:
        """Validate `tools` / `environment_factory` and return what the trainer needs before the base `__init__`:
        `tools`, `pool`, `reward_funcs` (with the environments' rewards appended) and `train_dataset`."""
        setup = {"tools": [], "pool": None, "reward_funcs": reward_funcs, "train_dataset": train_dataset}
        if tools is None and environment_factory is None:
            return setup
        require_response_parser_support()
        if rollout_func is not None:
            raise ValueError(
                "tools/environment_factory cannot be combined with rollout_func: the tool loop runs on the trainer's "
                "own generation, which rollout_func replaces. Run the tool calls inside your rollout_func, or drop it."
            )
        setup["tools"] = validate_tools(tools)
        require_conversational_prompts(train_dataset)
        if environment_factory is not None:
            pool = _EnvironmentPool(environment_factory)
            setup["pool"] = pool
            extra = [_environment_reward(klass.__name__, klass) for klass in environment_reward_classes(pool)]
            if extra:
                funcs = (
                    []
                    if reward_funcs is None
                    else list(reward_funcs)
                    if isinstance(reward_funcs, (list, tuple))
                    else [reward_funcs]
                )
                setup["reward_funcs"] = funcs + extra
            if train_dataset is None:
                rows = max(1, args.generation_batch_size // args.num_generations) if args is not None else 1
                setup["train_dataset"] = environment_placeholder_dataset(pool, args, rows)
        return setup

    def _init_tools(self, setup: dict[str, Any]) -> None:
        """Store the tool setup and check that the tokenizer can render tools and parse tool calls."""
        self.tools = setup["tools"]
        self._environment_pool = setup["pool"]
        self._tools_enabled = bool(self.tools) or self._environment_pool is not None
        if not self._tools_enabled:
            return
        tokenizer = self.processing_class
        require_tool_calling_template(tokenizer)
        if not is_chat_template_prefix_preserving(tokenizer):
            # Checked again per rollout (`_tool_glue_text`) for the real conversations; this catches it before training.
            raise ValueError(
                f"The chat template of the {type(tokenizer).__name__} is not prefix-preserving: appending a tool result "
                "to a conversation changes the tokens of its earlier turns, so a multi-turn completion cannot be "
                "extended turn by turn. Use a template where appending messages only appends text (the qwen2_5 and "
                "llama3 templates in trl/chat_templates are), or drop tools/environment_factory."
            )
        ensure_response_parser(tokenizer)
        self._tool_call_limit = getattr(self.args, "max_tool_calling_iterations", None)

    # ------------------------------------------------------------------------------------------------------------
    # The rollout
    # ------------------------------------------------------------------------------------------------------------
    def _prepare_rollout_rows(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Before generation (as TRL): each row gets its environment (`self.environments`), `reset(**row)` may extend
        its last user message, and its tools (trainer-wide, the environment's methods, the dataset's `tools` column)
        are fixed for the rollout."""
        inputs = super()._prepare_rollout_rows(inputs)
        if not self._tools_enabled:
            return inputs
        num = len(inputs)
        prompts = [copy.deepcopy(example["prompt"]) for example in inputs]
        if not is_conversational({"prompt": prompts[0]}):
            raise ValueError(
                "Tool calling needs conversational prompts (lists of chat messages) so that tools and tool results "
                f"are rendered with the chat template; found a {type(prompts[0]).__name__} prompt. Convert the "
                "prompts to e.g. [{'role': 'user', 'content': ...}]."
            )
        environments = self._environment_pool.acquire(inputs) if self._environment_pool is not None else [None] * num
        row_tools: list[list[Any]] = []
        row_tool_maps: list[dict[str, Callable]] = []
        for i, (example, environment) in enumerate(zip(inputs, environments)):
            callables = list(self.tools)
            if environment is not None:
                columns = {key: value for key, value in example.items() if key != "prompt"}
                observation = environment.reset(**_accepted_kwargs(environment.reset, columns))
                if observation is not None:
                    self._append_to_last_user_message(prompts[i], str(observation))
                callables += environment_tools(environment)
            mapping = {get_callable_name(func): func for func in callables}
            schemas = list(callables)
            dataset_tools = example.get("tools")
            if isinstance(dataset_tools, str):
                dataset_tools = json.loads(dataset_tools)
            if dataset_tools:
                schemas += list(dataset_tools)  # described to the model, but not executable here
            row_tools.append(schemas)
            row_tool_maps.append(mapping)
        self.environments = environments if environments[0] is not None else None
        self._row_tools, self._row_tool_maps = row_tools, row_tool_maps
        return [{**example, "prompt": prompt} for example, prompt in zip(inputs, prompts)]

    def _prompt_rows_of(self, prompts: list[Any]) -> list[dict[str, Any]]:
        rows = super()._prompt_rows_of(prompts)
        row_tools = self.__dict__.get("_row_tools")
        if self._tools_enabled and row_tools is not None and len(row_tools) == len(rows):
            rows = [{**row, "tools": tools} for row, tools in zip(rows, row_tools)]
        return rows

    def _rollout(self, prompts: list[Any]) -> dict[str, Any]:
        if not self._tools_enabled:
            return super()._rollout(prompts)
        return self._tool_rollout(prompts)

    def _generate_turn(
        self, prompt_ids: list[list[int]], images: Any, multimodal_fields: dict[str, Any], num_generations: int
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One turn through `_generate_single_turn` (TRL's hook) with the trainer's argument shape."""
        extra = (num_generations,) if self._single_turn_takes_num_generations else ()
        return self._single_turn_result(self._generate_single_turn(prompt_ids, images, multimodal_fields, *extra))

    def _tool_rollout(self, prompts: list[Any]) -> dict[str, Any]:
        num = len(prompts)
        row_tools, row_tool_maps = self._row_tools, self._row_tool_maps
        inputs = self._prompt_rows_of(prompts)
        prompt_ids, images, multimodal_fields = self._tokenize_prompts(prompts)
        self.__dict__.pop("_image_prompts", None)
        if images is not None:
            raise ValueError(
                "Tool calling with image prompts is not supported: later turns are generated from token ids without "
                "their images. Train tools on text prompts, or drop tools/environment_factory."
            )
        # ---- First turn ----------------------------------------------------------------------------------------
        completion_ids, sampling = self._generate_turn(prompt_ids, None, multimodal_fields, self._group_size())
        prompt_ids = [list(ids) for ids in prompt_ids]
        completion_ids = [list(ids) for ids in completion_ids]
        tool_mask = [[1] * len(ids) for ids in completion_ids]
        uses_sampling = self._uses_sampling_logps()
        sampling = [list(lp) for lp in sampling] if sampling is not None and uses_sampling else None
        messages: list[list[dict[str, Any]]] = [[] for _ in range(num)]
        last_turn = {i: completion_ids[i] for i in range(num)}
        budget = self.max_completion_length
        eos = set(self.eos_token_ids)
        tokenizer = self.processing_class
        calls = failures = 0
        truncated = 0
        iterations = 0

        while True:
            # Parse the turn just generated by each active row; finished turns with tool calls are pending.
            pending = []
            for i, turn_ids in last_turn.items():
                # The parser needs what preceded the turn (the template may pre-write part of the answer).
                history = completion_ids[i][: len(completion_ids[i]) - len(turn_ids)]
                # The row's tools let the parser cast text arguments (XML-style calls) to their declared types.
                message = parse_response(tokenizer, turn_ids, prefix=prompt_ids[i] + history, tools=row_tools[i])
                messages[i].append(message)
                finished = bool(turn_ids) and turn_ids[-1] in eos
                if finished and message.get("tool_calls") and len(completion_ids[i]) < budget:
                    pending.append(i)
            if self._tool_call_limit is not None and iterations >= self._tool_call_limit:
                pending = []
            last_turn = {}

            # Execute the calls of every pending row (async tools run concurrently) and append the tool results.
            continuing = []
            if pending:
                results, row_calls, row_failures = self._execute_tool_calls(
                    [messages[i][-1]["tool_calls"] for i in pending], [row_tool_maps[i] for i in pending]
                )
                calls += row_calls
                failures += row_failures
                for i, tool_messages in zip(pending, results):
                    end_token = tokenizer.decode([completion_ids[i][-1]])
                    glue = self._tool_glue_text(
                        prompts[i], messages[i], tool_messages, row_tools[i], inputs[i], end_token
                    )
                    messages[i].extend(tool_messages)
                    glue_ids = tokenizer(text=glue, add_special_tokens=False)["input_ids"]
                    completion_ids[i] += glue_ids
                    tool_mask[i] += [0] * len(glue_ids)
                    if sampling is not None:
                        sampling[i] += [0.0] * len(glue_ids)
                    if len(completion_ids[i]) >= budget:
                        truncated += 1  # no room left to answer; cut below
                        continue
                    continuing.append(i)
            # Generation may be collective (vLLM, ZeRO-3): every process runs the same number of turns.
            if not self._any_process(bool(continuing)):
                break
            iterations += 1
            if not continuing:  # other processes still generate: take part with a throw-away row
                self._generate_limited([prompt_ids[0]], 1)
                continue

            # Generate the next turn of those rows, from exactly the tokens so far.
            next_ids = [prompt_ids[i] + completion_ids[i] for i in continuing]
            remaining = max(budget - len(completion_ids[i]) for i in continuing)
            turn_completions, turn_sampling = self._generate_limited(next_ids, remaining)
            if turn_sampling is None:
                sampling = None
            for k, i in enumerate(continuing):
                turn_ids = list(turn_completions[k])[: budget - len(completion_ids[i])]
                completion_ids[i] += turn_ids
                tool_mask[i] += [1] * len(turn_ids)
                if sampling is not None:
                    sampling[i] += list(turn_sampling[k])[: len(turn_ids)]
                last_turn[i] = turn_ids

        # ---- Budget ---------------------------------------------------------------------------------------------
        for i in range(num):
            if len(completion_ids[i]) > budget:
                completion_ids[i] = completion_ids[i][:budget]
                tool_mask[i] = tool_mask[i][:budget]
                if sampling is not None:
                    sampling[i] = sampling[i][:budget]
        if truncated:
            logger.warning(
                "%d multi-turn completion(s) reached max_completion_length=%d after a tool result and were truncated.",
                truncated,
                budget,
            )

        self._record_tool_metrics(calls, failures, num)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "sampling_logps": sampling,
            "extra_fields": {},
            "completions": messages,
            "tool_mask": tool_mask,
            "images": None,
            "tool_images": [],
        }

    def _generate_limited(
        self, prompt_ids: list[list[int]], max_new_tokens: int
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """A later turn (one completion per row of exact token ids) with at most `max_new_tokens` new tokens."""
        original = self.generation_config
        limited = copy.deepcopy(original)
        limited.max_new_tokens = max(1, min(max_new_tokens, original.max_new_tokens or max_new_tokens))
        self.generation_config = limited
        vllm_generation = self.vllm_generation
        if vllm_generation is not None:
            original_max_tokens = vllm_generation.max_tokens
            # vLLM's server mode samples every process's rows with one limit: the largest one asked for.
            vllm_generation.max_tokens = min(self._max_over_processes(limited.max_new_tokens), original_max_tokens)
        try:
            return self._generate_turn(prompt_ids, None, {}, 1)
        finally:
            self.generation_config = original
            if vllm_generation is not None:
                vllm_generation.max_tokens = original_max_tokens

    @staticmethod
    def _append_to_last_user_message(prompt: list[dict[str, Any]], text: str) -> None:
        for message in reversed(prompt):
            if message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, list):  # multimodal content blocks
                    content.append({"type": "text", "text": text})
                else:
                    message["content"] = (content or "") + text
                return
        prompt.append({"role": "user", "content": text})

    def _tool_glue_text(
        self,
        prompt: list[dict[str, Any]],
        conversation: list[dict[str, Any]],
        tool_messages: list[dict[str, Any]],
        tools: list[Any],
        example: dict[str, Any],
        end_token: str,
    ) -> str:
        """Text the chat template places between the end-of-turn token of the last assistant turn and the start of
        the next assistant turn (tool results and turn markers)."""
        template_kwargs = {**self.chat_template_kwargs, **(example.get("chat_template_kwargs") or {})}
        template_kwargs.pop("add_generation_prompt", None)
        before = self.processing_class.apply_chat_template(
            prompt + conversation, tools=tools, tokenize=False, **template_kwargs
        )
        after = self.processing_class.apply_chat_template(
            prompt + conversation + tool_messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=True,
            **template_kwargs,
        )
        if not after.startswith(before):
            raise ValueError(
                "The chat template is not prefix-preserving: rendering the conversation with the tool results changes "
                "the text of the earlier turns, so the multi-turn completion cannot be extended token by token. Use "
                "a template where appending messages only appends text (see "
                "`trl.chat_template_utils.is_chat_template_prefix_preserving`)."
            )
        added = after[len(before) :]
        if end_token and added.startswith(end_token):
            # The template writes the end of a turn only once another message follows (GLM-4-MoE's original): the
            # completion already holds it. (An earlier occurrence in `before`, e.g. in the content, is not that end.)
            return added[len(end_token) :]
        position = before.rfind(end_token) if end_token else -1
        tail = before[position + len(end_token) :] if position >= 0 else ""
        return tail + added

    def _execute_tool_calls(
        self, calls_per_row: list[list[dict[str, Any]]], tool_maps: list[dict[str, Callable]]
    ) -> tuple[list[list[dict[str, Any]]], int, int]:
        """Run the tool calls of several rows; returns the tool messages per row, the call and failure counts."""
        results, records = execute_tool_calls(calls_per_row, tool_maps)
        return results, len(records), sum(record.failed for record in records)

    def _any_process(self, flag: bool) -> bool:
        """Whether `flag` holds on any process (the flag itself on a single process)."""
        return self._max_over_processes(int(flag)) > 0

    def _max_over_processes(self, value: int) -> int:
        """The largest of every process's `value` (the value itself on a single process)."""
        if self.accelerator.num_processes == 1:
            return value
        tensor = torch.tensor([value], device=self.accelerator.device)
        return int(self.accelerator.gather(tensor).max().item())

    def _record_tool_metrics(self, calls: int, failures: int, completions: int) -> None:
        device = self.accelerator.device
        totals = torch.tensor([[calls, failures, completions]], dtype=torch.float64, device=device)
        totals = self.accelerator.gather(totals).sum(dim=0)
        all_calls, all_failures, all_completions = totals.tolist()
        metrics = self._metrics[self._mode]
        metrics["tools/call_frequency"].append(all_calls / max(all_completions, 1.0))
        metrics["tools/failure_frequency"].append(all_failures / all_calls if all_calls > 0 else 0.0)

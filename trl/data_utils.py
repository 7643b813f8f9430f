"""Dataset utilities: format detection, chat-template rendering, prompt extraction, unpairing, packing, truncation.

A dataset is either *standard* (values are plain strings) or *conversational* (values are lists of
`{"role": ..., "content": ...}` messages). The functions below work on single examples (to be used with
`dataset.map`) or on whole `Dataset` / `IterableDataset` objects, as documented on each function.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, List, Value


DatasetType = TypeVar("DatasetType", Dataset, DatasetDict, IterableDataset, IterableDatasetDict)

# Keys whose values may hold a list of messages.
_CONVERSATIONAL_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")
# Roles accepted in conversational examples ("developer" is the system role of some recent templates).
ALLOWED_ROLES = ("system", "developer", "user", "assistant", "tool")
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")


# ----------------------------------------------------------------------------------------------------------------
# Conversational format detection and conversion
# ----------------------------------------------------------------------------------------------------------------


def _is_message_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


def is_conversational(example: dict[str, Any]) -> bool:
    """Tell whether an example is in conversational format.

    The first of the keys `"prompt"`, `"chosen"`, `"rejected"`, `"completion"` and `"messages"` present in the
    example is inspected: the example is conversational when that value is a list whose first element is a dict with
    a `"role"` key.

    Args:
        example (`dict[str, Any]`):
            A single dataset row.

    Returns:
        `bool`: `True` if the example is conversational, `False` otherwise.

    Example:
    ```python
    >>> is_conversational({"prompt": [{"role": "user", "content": "What color is the sky?"}]})
    True
    >>> is_conversational({"prompt": "The sky is"})
    False
    ```
    """
    for key in _CONVERSATIONAL_KEYS:
        if key in example:
            return _is_message_list(example[key])
    return False


def is_conversational_from_value(example: dict[str, Any]) -> bool:
    """Tell whether an example is a ShareGPT-style conversation (`"from"` / `"value"` message keys).

    Such examples store their conversation under the `"conversations"` key, e.g.
    `{"conversations": [{"from": "user", "value": "Hi"}]}`. Use [`maybe_convert_to_chatml`] to convert them to the
    `"role"` / `"content"` (ChatML) convention.

    Args:
        example (`dict[str, Any]`):
            A single dataset row.

    Returns:
        `bool`: `True` if `example["conversations"]` is a list whose first message has both `"from"` and `"value"`.

    Example:
    ```python
    >>> is_conversational_from_value({"conversations": [{"from": "user", "value": "Hi"}]})
    True
    >>> is_conversational_from_value({"messages": [{"role": "user", "content": "Hi"}]})
    False
    ```
    """
    conversation = example.get("conversations")
    if isinstance(conversation, list) and len(conversation) > 0:
        first = conversation[0]
        return isinstance(first, dict) and "from" in first and "value" in first
    return False


def maybe_convert_to_chatml(example: dict[str, list]) -> dict[str, list]:
    """Convert a ShareGPT-style (`"from"` / `"value"`) example to ChatML (`"role"` / `"content"`).

    In each message of the `"prompt"`, `"completion"`, `"chosen"`, `"rejected"`, `"messages"` and `"conversations"`
    fields, `"from"` is renamed to `"role"` and `"value"` to `"content"` (the messages are modified in place). Then
    the `"conversations"` key is renamed to `"messages"`. Examples already in ChatML are returned unchanged.

    Args:
        example (`dict[str, list]`):
            A single dataset row.

    Returns:
        `dict[str, list]`: The converted example.

    Example:
    ```python
    >>> maybe_convert_to_chatml({"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "yo"}]})
    {'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'yo'}]}
    ```
    """
    for key in ("prompt", "completion", "chosen", "rejected", "messages", "conversations"):
        messages = example.get(key)
        if not isinstance(messages, list):
            continue
        for message in messages:
            if not isinstance(message, dict):
                continue
            if "from" in message:
                message["role"] = message.pop("from")
            if "value" in message:
                message["content"] = message.pop("value")
    if "conversations" in example:
        example["messages"] = example.pop("conversations")
    return example


# ----------------------------------------------------------------------------------------------------------------
# Chat template rendering
# ----------------------------------------------------------------------------------------------------------------

_CHAT_TEMPLATE_KEY_SETS = (
    {"messages"},  # language modeling
    {"prompt"},  # prompt-only
    {"prompt", "completion"},  # prompt-completion
    {"prompt", "chosen", "rejected"},  # preference with explicit prompt
    {"chosen", "rejected"},  # preference with implicit prompt
    {"prompt", "completion", "label"},  # unpaired preference
)
_CHAT_TEMPLATE_KEYS = ("prompt", "chosen", "rejected", "completion", "messages", "label")


def _check_roles(messages: list[dict[str, Any]], field: str) -> None:
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ALLOWED_ROLES:
            raise ValueError(
                f"Message {index} of the '{field}' field has role {role!r}, but the role of every message must be one "
                f"of {list(ALLOWED_ROLES)}. Rename the role of that message (e.g. with `dataset.map`) to one of "
                "the allowed roles."
            )


def _check_has_chat_template(processing_class: Any) -> None:
    if getattr(processing_class, "chat_template", None):
        return
    name = getattr(processing_class, "name_or_path", None) or "<unnamed>"
    raise ValueError(
        f"The processing class {type(processing_class).__name__} ({name!r}) has no chat template, but a "
        "conversational example can only be rendered with one. Set a chat template first: pass `chat_template_path` "
        "in the trainer config, call `trl.clone_chat_template(model, tokenizer, source_tokenizer_path)`, or assign a "
        "Jinja template string to `tokenizer.chat_template`."
    )


def _resolve_tools(example: dict[str, Any], tools: list | None) -> list | None:
    # A per-example `tools` column takes precedence over the function argument; datasets often store it as JSON.
    example_tools = example.get("tools")
    if example_tools is None:
        return tools
    if isinstance(example_tools, str):
        try:
            example_tools = json.loads(example_tools)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"The 'tools' field is a string but not valid JSON ({error}). Store a list of JSON schemas, or a JSON "
                "string encoding such a list."
            ) from error
    if not isinstance(example_tools, list):
        raise ValueError(
            f"The 'tools' field must be a list of tool schemas/callables or a JSON string encoding a list, found "
            f"{type(example_tools).__name__}."
        )
    return example_tools


def _longest_common_prefix(text: str, other: str) -> str:
    limit = min(len(text), len(other))
    index = 0
    while index < limit and text[index] == other[index]:
        index += 1
    return text[:index]


def apply_chat_template(
    example: dict[str, list[dict[str, str]]],
    processing_class: Any,
    tools: list[dict | Callable] | None = None,
    **template_kwargs: Any,
) -> dict[str, str]:
    """Render a conversational example to text with the chat template of `processing_class`.

    The example must contain exactly one of these sets of keys (other keys, such as `"images"`, `"tools"` or
    `"chat_template_kwargs"`, are ignored for this check): `{"messages"}`, `{"prompt"}`, `{"prompt", "completion"}`,
    `{"prompt", "chosen", "rejected"}`, `{"chosen", "rejected"}` or `{"prompt", "completion", "label"}`.

    - `"messages"` is rendered as a whole and returned under `"text"`.
    - `"prompt"` is rendered with the generation prompt when its last message comes from the user or a tool, or as a
      continuation of the final message when its last message comes from the assistant.
    - `"completion"`, `"chosen"` and `"rejected"` are rendered together with the prompt; the prompt text is then cut
      back to the longest common prefix of both renderings and the answer is the remainder, so that the answer starts
      exactly where the rendered prompt ends.
    - Without a prompt, `"chosen"` and `"rejected"` are rendered on their own.
    - `"label"` is copied through unchanged.

    Args:
        example (`dict[str, list[dict[str, str]]]`):
            A conversational example. An optional `"tools"` field (a list, or a JSON string encoding a list) overrides
            the `tools` argument, and an optional `"chat_template_kwargs"` dict is merged into the template call.
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            Tokenizer or processor whose `apply_chat_template` is used. It must define a chat template.
        tools (`list[dict | Callable]`, *optional*):
            Tools (JSON schemas or Python functions) made available to the model through the template.
        **template_kwargs:
            Extra keyword arguments forwarded to `apply_chat_template` (template variables such as
            `enable_thinking`).

    Returns:
        `dict[str, str]`: The rendered example, with keys among `"text"`, `"prompt"`, `"completion"`, `"chosen"`,
        `"rejected"` and `"label"`.

    Raises:
        KeyError: If the example keys do not form one of the supported sets.
        ValueError: If a message has an unknown role, the prompt ends with an unsupported role, or the processing
            class has no chat template.

    Example:
    ```python
    >>> from transformers import AutoTokenizer
    >>> from trl.assets import get_tokenizer_path
    >>> tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_path("qwen2_5"))
    >>> example = {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}
    >>> apply_chat_template(example, tokenizer)["completion"]
    '4<|im_end|>\\n'
    ```
    """
    keys = {key for key in example if key in _CHAT_TEMPLATE_KEYS}
    if keys not in _CHAT_TEMPLATE_KEY_SETS:
        expected = " or ".join(str(sorted(key_set)) for key_set in _CHAT_TEMPLATE_KEY_SETS)
        raise KeyError(
            f"Invalid keys in the example: {sorted(keys)}. Expected one of these key sets: {expected}. Rename your "
            "columns (e.g. `dataset.rename_column(old, new)`) or remove the extra ones."
        )
    _check_has_chat_template(processing_class)
    for key in ("prompt", "completion", "chosen", "rejected", "messages"):
        if key in example:
            if not isinstance(example[key], list):
                raise ValueError(
                    f"The '{key}' field must be a list of messages (conversational format) to apply a chat template, "
                    f"found {type(example[key]).__name__}. Use `maybe_apply_chat_template` for datasets that may be "
                    "in standard format."
                )
            _check_roles(example[key], key)

    tools = _resolve_tools(example, tools)
    kwargs = {key: value for key, value in (example.get("chat_template_kwargs") or {}).items() if value is not None}
    kwargs.update(template_kwargs)
    kwargs["tokenize"] = False
    kwargs.pop("add_generation_prompt", None)
    kwargs.pop("continue_final_message", None)

    def render(messages: list[dict[str, Any]], **extra: Any) -> str:
        return processing_class.apply_chat_template(messages, tools=tools, **kwargs, **extra)

    output: dict[str, Any] = {}
    if "messages" in example:
        output["text"] = render(example["messages"])

    if "prompt" in example:
        prompt_messages = example["prompt"]
        if len(prompt_messages) == 0:
            raise ValueError("The 'prompt' field is an empty list of messages; it needs at least one message.")
        last_role = prompt_messages[-1]["role"]
        if last_role in ("user", "tool"):
            prompt = render(prompt_messages, add_generation_prompt=True)
        elif last_role == "assistant":
            prompt = render(prompt_messages, continue_final_message=True)
        else:
            raise ValueError(
                f"The last message of the prompt has role {last_role!r}, but it must be one of ['user', 'tool'] (the "
                "generation prompt is added) or 'assistant' (the message is continued)."
            )
        # Rendering prompt + answer can differ from the bare prompt right at the junction (e.g. templates that
        # insert a thinking block after the generation prompt). Cutting the prompt back to the longest common prefix
        # guarantees that every answer starts exactly where the prompt ends.
        answers = {}
        for key in ("completion", "chosen", "rejected"):
            if key in example:
                full = render(prompt_messages + example[key])
                prompt = _longest_common_prefix(prompt, full)
                answers[key] = full
        output["prompt"] = prompt
        for key, full in answers.items():
            output[key] = full[len(prompt) :]
    else:
        for key in ("chosen", "rejected"):
            if key in example:
                output[key] = render(example[key])

    if "label" in example:
        output["label"] = example["label"]
    return output


def maybe_apply_chat_template(
    example: dict[str, list[dict[str, str]]],
    processing_class: Any,
    tools: list[dict | Callable] | None = None,
    **template_kwargs: Any,
) -> dict[str, str]:
    """Apply [`apply_chat_template`] to conversational examples and return standard ones unchanged.

    Args:
        example (`dict[str, list[dict[str, str]]]`):
            A single dataset row, standard or conversational.
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            Tokenizer or processor used to render conversational examples.
        tools (`list[dict | Callable]`, *optional*):
            Tools made available to the model through the template.
        **template_kwargs:
            Extra keyword arguments forwarded to `apply_chat_template`.

    Returns:
        `dict[str, str]`: The rendered example (conversational input) or the input example (standard input).

    Example:
    ```python
    >>> maybe_apply_chat_template({"prompt": "The sky is", "completion": " blue."}, tokenizer)
    {'prompt': 'The sky is', 'completion': ' blue.'}
    ```
    """
    if is_conversational(example):
        return apply_chat_template(example, processing_class, tools=tools, **template_kwargs)
    return example


# ----------------------------------------------------------------------------------------------------------------
# Prompt extraction and unpairing
# ----------------------------------------------------------------------------------------------------------------


def extract_prompt(example: dict[str, Sequence]) -> dict[str, Sequence]:
    """Split the shared beginning of `"chosen"` and `"rejected"` into an explicit `"prompt"`.

    The prompt is everything before the first position where the two sequences differ. For strings, a space right
    before that position is left at the start of the answers rather than at the end of the prompt. Works on strings
    (standard) and on message lists (conversational).

    Args:
        example (`dict[str, Sequence]`):
            A row with `"chosen"` and `"rejected"` (implicit prompt preference format).

    Returns:
        `dict[str, Sequence]`: `{"prompt": ..., "chosen": ..., "rejected": ...}`.

    Example:
    ```python
    >>> extract_prompt({"chosen": "Sky is blue.", "rejected": "Sky is green."})
    {'prompt': 'Sky is', 'chosen': ' blue.', 'rejected': ' green.'}
    ```
    """
    chosen, rejected = example["chosen"], example["rejected"]
    limit = min(len(chosen), len(rejected))
    index = 0
    while index < limit and chosen[index] == rejected[index]:
        index += 1
    # Keep the separating space with the answers (" blue." rather than "Sky is " + "blue.").
    if 0 < index < limit and isinstance(chosen, str) and chosen[index - 1] == " ":
        index -= 1
    return {"prompt": chosen[:index], "chosen": chosen[index:], "rejected": rejected[index:]}


def maybe_extract_prompt(example: dict[str, list]) -> dict[str, list]:
    """Extract an explicit prompt from a preference example when it does not already have one.

    Examples without both `"chosen"` and `"rejected"` are returned unchanged, and so are examples that already have
    a `"prompt"` whose format (standard or conversational) matches the one of `"chosen"`. Otherwise
    [`extract_prompt`] is applied.

    Args:
        example (`dict[str, list]`):
            A single dataset row.

    Returns:
        `dict[str, list]`: The example with an explicit prompt, or the unchanged example.

    Example:
    ```python
    >>> maybe_extract_prompt({"chosen": "Sky is blue.", "rejected": "Sky is green."})
    {'prompt': 'Sky is', 'chosen': ' blue.', 'rejected': ' green.'}
    >>> maybe_extract_prompt({"prompt": "Sky is", "chosen": " blue.", "rejected": " green."})
    {'prompt': 'Sky is', 'chosen': ' blue.', 'rejected': ' green.'}
    ```
    """
    if "chosen" not in example or "rejected" not in example:
        return example
    if "prompt" in example:
        chosen_is_conversational = is_conversational({"chosen": example["chosen"]})
        prompt_is_conversational = is_conversational({"prompt": example["prompt"]})
        if chosen_is_conversational == prompt_is_conversational:
            return example
    return extract_prompt({"chosen": example["chosen"], "rejected": example["rejected"]})


def _filter_map_kwargs(dataset: Any, map_kwargs: dict[str, Any]) -> dict[str, Any]:
    # `IterableDataset.map` does not accept the arguments that only make sense for materialised datasets.
    if isinstance(dataset, (IterableDataset, IterableDatasetDict)):
        unsupported = {"num_proc", "desc", "load_from_cache_file", "keep_in_memory", "cache_file_name"}
        unsupported |= {"writer_batch_size", "new_fingerprint", "with_rank", "suffix_template", "disable_nullable"}
        return {key: value for key, value in map_kwargs.items() if key not in unsupported}
    return dict(map_kwargs)


def _unpair_batch(batch: dict[str, list]) -> dict[str, list]:
    size = len(batch["chosen"])
    output = {}
    for key, values in batch.items():
        if key not in ("chosen", "rejected"):
            output[key] = list(values) + list(values)
    output["completion"] = list(batch["chosen"]) + list(batch["rejected"])
    output["label"] = [True] * size + [False] * size
    return output


def unpair_preference_dataset(dataset: DatasetType, **map_kwargs: Any) -> DatasetType:
    """Turn a paired preference dataset into an unpaired one.

    Each row `{"prompt", "chosen", "rejected", ...}` becomes two rows: `{"prompt", "completion": chosen,
    "label": True, ...}` and `{"prompt", "completion": rejected, "label": False, ...}`. Other columns are duplicated.
    Within each mapped batch, all the chosen rows come first, followed by all the rejected rows.

    Args:
        dataset (`Dataset`, `DatasetDict`, `IterableDataset` or `IterableDatasetDict`):
            Preference dataset with `"chosen"` and `"rejected"` columns (and optionally `"prompt"`).
        **map_kwargs:
            Keyword arguments forwarded to `dataset.map` (e.g. `num_proc`, `desc`, `batch_size`).

    Returns:
        The unpaired dataset, of the same type as the input.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> dataset = Dataset.from_dict({"prompt": ["Sky is"], "chosen": [" blue"], "rejected": [" green"], "x": [1]})
    >>> unpair_preference_dataset(dataset)[:]
    {'prompt': ['Sky is', 'Sky is'], 'x': [1, 1], 'completion': [' blue', ' green'], 'label': [True, False]}
    ```
    """
    kwargs = _filter_map_kwargs(dataset, map_kwargs)
    kwargs["batched"] = True
    return dataset.map(_unpair_batch, remove_columns=["chosen", "rejected"], **kwargs)


def get_dataset_column_names(dataset: Dataset | IterableDataset | DatasetDict | IterableDatasetDict) -> list[str]:
    """Return the column names of a dataset.

    Uses `dataset.column_names`; when it is unknown (some iterable datasets), the keys of the first row are returned.
    For dataset dicts, the columns of the first split are returned.

    Args:
        dataset (`Dataset`, `IterableDataset`, `DatasetDict` or `IterableDatasetDict`):
            The dataset to inspect.

    Returns:
        `list[str]`: The column names (empty for an iterable dataset with no rows).

    Example:
    ```python
    >>> get_dataset_column_names(Dataset.from_dict({"prompt": ["a"], "completion": ["b"]}))
    ['prompt', 'completion']
    ```
    """
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        if len(dataset) == 0:
            return []
        return get_dataset_column_names(next(iter(dataset.values())))
    column_names = dataset.column_names
    if column_names is not None:
        return list(column_names)
    first_row = next(iter(dataset), None)
    return list(first_row.keys()) if first_row is not None else []


def maybe_unpair_preference_dataset(
    dataset: DatasetType, num_proc: int | None = None, desc: str | None = None
) -> DatasetType:
    """Unpair a preference dataset if it has both `"chosen"` and `"rejected"` columns, else return it unchanged.

    Args:
        dataset (`Dataset`, `DatasetDict`, `IterableDataset` or `IterableDatasetDict`):
            The dataset to unpair.
        num_proc (`int`, *optional*):
            Number of processes used by `map` (ignored for iterable datasets).
        desc (`str`, *optional*):
            Progress bar description used by `map` (ignored for iterable datasets).

    Returns:
        The unpaired dataset, or the input dataset unchanged.

    Example:
    ```python
    >>> dataset = Dataset.from_dict({"prompt": ["Sky is"], "completion": [" blue"], "label": [True]})
    >>> maybe_unpair_preference_dataset(dataset) is dataset
    True
    ```
    """
    column_names = get_dataset_column_names(dataset)
    if "chosen" in column_names and "rejected" in column_names:
        return unpair_preference_dataset(dataset, num_proc=num_proc, desc=desc)
    return dataset


# ----------------------------------------------------------------------------------------------------------------
# Dataset format detection / validation
# ----------------------------------------------------------------------------------------------------------------

DATASET_FORMATS: dict[str, str] = {
    "language_modeling": "'text' (standard) or 'messages' (conversational)",
    "prompt_only": "'prompt'",
    "prompt_completion": "'prompt', 'completion'",
    "preference": "'prompt', 'chosen', 'rejected'",
    "implicit_preference": "'chosen', 'rejected'",
    "unpaired_preference": "'prompt', 'completion', 'label'",
    "stepwise_supervision": "'prompt', 'completions', 'labels'",
    "tokenized": "'input_ids' (pre-tokenized, e.g. also 'completion_mask', 'assistant_masks', 'seq_lengths')",
}


def detect_dataset_format(example_or_columns: dict[str, Any] | Sequence[str], text_field: str = "text") -> str:
    """Detect the format type of a dataset from one of its rows or from its column names.

    The checks run from the most to the least specific: `"tokenized"` (an `input_ids` column, or any `*_input_ids`
    column), `"stepwise_supervision"` (`prompt`, `completions`, `labels`), `"unpaired_preference"` (`prompt`,
    `completion`, `label`), `"preference"` (`prompt`, `chosen`, `rejected`), `"implicit_preference"` (`chosen`,
    `rejected`), `"prompt_completion"` (`prompt`, `completion`), `"language_modeling"` (`text_field`, `messages` or
    ShareGPT-style `conversations`) and `"prompt_only"` (`prompt`). Extra columns are ignored.

    Args:
        example_or_columns (`dict[str, Any]` or `Sequence[str]`):
            A dataset row (its keys are used) or the list of column names.
        text_field (`str`, *optional*, defaults to `"text"`):
            Name of the column holding raw text for language modeling.

    Returns:
        `str`: One of `"language_modeling"`, `"prompt_only"`, `"prompt_completion"`, `"preference"`,
        `"implicit_preference"`, `"unpaired_preference"`, `"stepwise_supervision"` or `"tokenized"`.

    Raises:
        ValueError: If the columns match none of the known formats.

    Example:
    ```python
    >>> detect_dataset_format(["prompt", "chosen", "rejected"])
    'preference'
    >>> detect_dataset_format({"messages": [{"role": "user", "content": "Hi"}]})
    'language_modeling'
    ```
    """
    if isinstance(example_or_columns, str):
        raise ValueError(
            f"Expected a dataset row (dict) or a list of column names, found the string {example_or_columns!r}. Wrap a "
            "single column name in a list."
        )
    columns = set(example_or_columns.keys() if isinstance(example_or_columns, dict) else example_or_columns)
    if "input_ids" in columns or any(column.endswith("_input_ids") for column in columns):
        return "tokenized"
    if {"prompt", "completions", "labels"} <= columns:
        return "stepwise_supervision"
    if {"prompt", "completion", "label"} <= columns:
        return "unpaired_preference"
    if {"prompt", "chosen", "rejected"} <= columns:
        return "preference"
    if {"chosen", "rejected"} <= columns:
        return "implicit_preference"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    if text_field in columns or "messages" in columns or "conversations" in columns:
        return "language_modeling"
    if "prompt" in columns:
        return "prompt_only"
    known = "\n".join(f"  - {name}: {cols}" for name, cols in DATASET_FORMATS.items())
    raise ValueError(
        f"Could not detect the dataset format from the columns {sorted(columns)}. Known formats and their columns:\n"
        f"{known}\nRename your columns to match one of them, e.g. with `dataset.rename_column(old, new)`."
    )


def _format_fix_hint(found: str | None, expected: Sequence[str], columns: Sequence[str]) -> str:
    hints = []
    if found in ("preference", "implicit_preference") and "unpaired_preference" in expected:
        hints.append("convert a paired preference dataset with `trl.unpair_preference_dataset(dataset)`")
    if found == "implicit_preference" and "preference" in expected:
        hints.append("extract an explicit prompt with `dataset.map(trl.maybe_extract_prompt)`")
    if "language_modeling" in expected and found is None:
        hints.append("set `dataset_text_field` to the name of the column holding your text")
    hints.append("rename your columns with `dataset.rename_column(old_name, new_name)`")
    hints.append("drop or rename conflicting columns with `dataset.remove_columns([...])`")
    if any(column == "conversations" for column in columns):
        hints.append("ShareGPT 'conversations' columns are converted with `trl.maybe_convert_to_chatml`")
    return "; ".join(hints)


def validate_dataset_format(
    dataset: Dataset | IterableDataset | DatasetDict | IterableDatasetDict | dict[str, Any] | Sequence[str],
    expected: Sequence[str],
    trainer_name: str,
    text_field: str = "text",
) -> str:
    """Check that a dataset is in one of the formats a trainer accepts.

    Args:
        dataset (`Dataset`, `IterableDataset`, `DatasetDict`, `IterableDatasetDict`, `dict` or `Sequence[str]`):
            The dataset, one of its rows, or its column names.
        expected (`Sequence[str]`):
            Accepted format types (see [`detect_dataset_format`]).
        trainer_name (`str`):
            Name of the trainer, used in the error message.
        text_field (`str`, *optional*, defaults to `"text"`):
            Name of the column holding raw text for language modeling.

    Returns:
        `str`: The detected format type.

    Raises:
        ValueError: If the format is unknown or not accepted. The message lists the columns expected for each
            accepted format, the columns found and how to fix the dataset.

    Example:
    ```python
    >>> validate_dataset_format(["prompt", "chosen", "rejected"], ["preference", "implicit_preference"], "DPOTrainer")
    'preference'
    ```
    """
    unknown = [name for name in expected if name not in DATASET_FORMATS]
    if unknown:
        raise ValueError(f"Unknown dataset format type(s) {unknown}; valid types are {list(DATASET_FORMATS)}.")
    if isinstance(dataset, (Dataset, IterableDataset, DatasetDict, IterableDatasetDict)):
        columns = get_dataset_column_names(dataset)
    elif isinstance(dataset, dict):
        columns = list(dataset.keys())
    else:
        columns = list(dataset)
    try:
        found = detect_dataset_format(columns, text_field=text_field)
    except ValueError:
        found = None
    if found in expected:
        return found
    accepted = "\n".join(
        f"  - {name}: {DATASET_FORMATS[name]}".replace("'text'", repr(text_field)) for name in expected
    )
    detected = f"which looks like the '{found}' format" if found else "which match no known format"
    raise ValueError(
        f"{trainer_name} expects a dataset in one of these formats (columns):\n{accepted}\n"
        f"but the dataset has columns {columns}, {detected}. How to fix: {_format_fix_hint(found, expected, columns)}."
    )


# ----------------------------------------------------------------------------------------------------------------
# Packing and truncation (pyarrow, vectorised)
# ----------------------------------------------------------------------------------------------------------------


def _is_list_type(data_type: pa.DataType) -> bool:
    return pa.types.is_list(data_type) or pa.types.is_large_list(data_type)


def _table_row_lengths(table: pa.Table) -> np.ndarray:
    """Per-row lengths shared by all the (list) columns of `table`, with null rows counted as empty."""
    lengths = None
    for name in table.column_names:
        column = table.column(name)
        if not _is_list_type(column.type):
            raise ValueError(
                f"pack_dataset needs every column to be a list column (e.g. token ids), but column {name!r} has type "
                f"{column.type}. Remove it first with `dataset.remove_columns([{name!r}])`."
            )
        column_lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy().astype(np.int64, copy=False)
        if lengths is None:
            lengths = column_lengths
        elif not np.array_equal(lengths, column_lengths):
            row = int(np.flatnonzero(lengths != column_lengths)[0])
            raise ValueError(
                f"pack_dataset needs all list columns to have the same length in every row, but in row {row} column "
                f"{table.column_names[0]!r} has {lengths[row]} elements and column {name!r} has "
                f"{column_lengths[row]}. Remove or fix the misaligned column before packing."
            )
    return np.zeros(table.num_rows, dtype=np.int64) if lengths is None else lengths


def _flatten(column: pa.ChunkedArray) -> pa.Array:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return array.flatten()


def _make_list_array(offsets: np.ndarray, values: pa.Array, list_type: pa.DataType) -> pa.Array:
    if pa.types.is_large_list(list_type):
        return pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), values, type=list_type)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values, type=list_type)


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out


def _best_fit_decreasing(piece_lengths: np.ndarray, seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Assign pieces (each of length 1..seq_length) to bins of capacity `seq_length` with best-fit decreasing.

    Pieces are placed longest first (ties keep their original order) into the open bin with the smallest remaining
    space that still fits them (the earliest created one among equals), or into a new bin. Bins are found with a
    segment tree indexed by remaining space plus one heap of bin ids per space value, so each placement costs
    O(log seq_length + log num_bins) instead of a scan over all open bins.

    Returns:
        `(bin_of_piece, bin_count)` where `bin_of_piece[i]` is the bin of piece `i` (bins numbered by creation order).
    """
    num_pieces = len(piece_lengths)
    order = np.argsort(-piece_lengths, kind="stable")
    size = 1
    while size < seq_length + 1:
        size *= 2
    # tree[node] = largest remaining space (leaf index) with at least one open bin in the subtree, or -1.
    tree = [-1] * (2 * size)
    buckets: list[list[int]] = [[] for _ in range(seq_length + 1)]

    def set_leaf(space: int, value: int) -> None:
        node = size + space
        tree[node] = value
        node //= 2
        while node:
            best = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == best:
                break
            tree[node] = best
            node //= 2

    bin_of_piece = np.empty(num_pieces, dtype=np.int64)
    num_bins = 0
    lengths = piece_lengths.tolist()
    for piece in order.tolist():
        length = lengths[piece]
        if tree[1] >= length:
            # Descend to the leftmost leaf whose space fits: since a leaf value equals its space, that is the
            # smallest remaining space >= length (best fit).
            node = 1
            while node < size:
                node = 2 * node if tree[2 * node] >= length else 2 * node + 1
            space = node - size
            bucket = buckets[space]
            bin_index = heapq.heappop(bucket)
            if not bucket:
                set_leaf(space, -1)
            remaining = space - length
        else:
            bin_index = num_bins
            num_bins += 1
            remaining = seq_length - length
        bin_of_piece[piece] = bin_index
        if remaining > 0:
            bucket = buckets[remaining]
            heapq.heappush(bucket, bin_index)
            if len(bucket) == 1:
                set_leaf(remaining, remaining)
    return bin_of_piece, num_bins


def _pack_bfd(examples: pa.Table, seq_length: int, split: bool = False) -> pa.Table:
    """Pack a batch of rows with best-fit decreasing; over-long rows are truncated (or split when `split`)."""
    lengths = _table_row_lengths(examples)
    rows = np.flatnonzero(lengths > 0)
    row_lengths = lengths[rows]
    if split:
        pieces_per_row = -(-row_lengths // seq_length)
        piece_row = np.repeat(rows, pieces_per_row)
        first_piece = _exclusive_cumsum(pieces_per_row)[:-1]
        piece_index_in_row = np.arange(len(piece_row), dtype=np.int64) - np.repeat(first_piece, pieces_per_row)
        piece_offset = piece_index_in_row * seq_length
        piece_length = np.minimum(seq_length, lengths[piece_row] - piece_offset)
    else:
        piece_row = rows
        piece_offset = np.zeros(len(rows), dtype=np.int64)
        piece_length = np.minimum(row_lengths, seq_length)

    bin_of_piece, num_bins = _best_fit_decreasing(piece_length, seq_length)
    # Output order: bins by creation, pieces inside a bin by placement order (i.e. length-decreasing, stable).
    placement = np.argsort(-piece_length, kind="stable")
    ordered = placement[np.argsort(bin_of_piece[placement], kind="stable")]
    ordered_length = piece_length[ordered]
    ordered_bins = bin_of_piece[ordered]

    # Gather indices into the flattened columns, built without a Python loop over tokens.
    row_starts = _exclusive_cumsum(lengths)
    source_start = row_starts[piece_row[ordered]] + piece_offset[ordered]
    target_start = _exclusive_cumsum(ordered_length)
    total = int(target_start[-1])
    gather = np.repeat(source_start - target_start[:-1], ordered_length) + np.arange(total, dtype=np.int64)
    gather = pa.array(gather, type=pa.int64())
    bin_sizes = np.bincount(ordered_bins, weights=ordered_length, minlength=num_bins).astype(np.int64)
    bin_offsets = _exclusive_cumsum(bin_sizes)

    arrays = []
    for name in examples.column_names:
        column = examples.column(name)
        values = _flatten(column).take(gather)
        arrays.append(_make_list_array(bin_offsets, values, column.type))
    pieces_per_bin = np.bincount(ordered_bins, minlength=num_bins)
    seq_lengths = pa.ListArray.from_arrays(
        pa.array(_exclusive_cumsum(pieces_per_bin), type=pa.int32()), pa.array(ordered_length, type=pa.int64())
    )
    return pa.Table.from_arrays([*arrays, seq_lengths], names=[*examples.column_names, "seq_lengths"])


def _pack_wrapped(examples: pa.Table, seq_length: int) -> pa.Table:
    """Concatenate all the rows of a batch and cut the result into consecutive chunks of `seq_length`."""
    total = int(_table_row_lengths(examples).sum())
    offsets = np.append(np.arange(0, total, seq_length, dtype=np.int64), total)
    arrays = [
        _make_list_array(offsets, _flatten(examples.column(name)), examples.column(name).type)
        for name in examples.column_names
    ]
    return pa.Table.from_arrays(arrays, names=examples.column_names)


def _format_of(dataset: Dataset | IterableDataset) -> dict[str, Any]:
    if isinstance(dataset, Dataset):
        return dict(dataset.format)
    formatting = getattr(dataset, "_formatting", None)
    return {"type": formatting.format_type if formatting is not None else None}


def _restore_format(dataset: Any, fmt: dict[str, Any], added_columns: Sequence[str] = ()) -> Any:
    if isinstance(dataset, Dataset):
        columns = fmt.get("columns")
        if columns is not None:
            columns = list(columns) + [column for column in added_columns if column not in columns]
        return dataset.with_format(
            fmt.get("type"),
            columns=columns,
            output_all_columns=fmt.get("output_all_columns", False),
            **fmt.get("format_kwargs", {}),
        )
    return dataset.with_format(fmt.get("type"))


def _map_arrow(dataset: Any, function: Callable, fn_kwargs: dict, map_kwargs: dict | None, added: Sequence[str]):
    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        return type(dataset)(
            {split: _map_arrow(part, function, fn_kwargs, map_kwargs, added) for split, part in dataset.items()}
        )
    fmt = _format_of(dataset)
    kwargs = _filter_map_kwargs(dataset, dict(map_kwargs or {}))
    kwargs["batched"] = True
    kwargs["fn_kwargs"] = {**kwargs.get("fn_kwargs", {}), **fn_kwargs}
    # A column subset or tensor formatting would hide columns from the function: work on plain arrow tables.
    mapped = dataset.with_format("arrow").map(function, **kwargs)
    if isinstance(mapped, Dataset) and len(mapped) == 0:
        # `map` never calls the function on an empty dataset: add the columns it would have created.
        for column in added:
            if column not in mapped.column_names:
                mapped = mapped.add_column(column, [], feature=List(Value("int64")))
    return _restore_format(mapped, fmt, added)


def pack_dataset(
    dataset: DatasetType, seq_length: int, strategy: str = "bfd", map_kwargs: dict[str, Any] | None = None
) -> DatasetType:
    """Pack the rows of a tokenized dataset into rows of at most `seq_length` elements.

    Every column must be a list column (e.g. `input_ids`, `completion_mask`, `assistant_masks`), with the same length
    in every row across columns; all columns are packed identically so they stay aligned. Packing runs batch by batch
    (`dataset.map(batched=True)`, batch size 1000 unless `map_kwargs` says otherwise) on pyarrow arrays.

    Strategies:
    - `"bfd"` (best-fit decreasing): empty rows are dropped, each row is truncated to `seq_length`, then rows are
      placed longest first into the packed row with the least remaining room that fits them. A `seq_lengths` column
      holds the lengths of the original sequences in each packed row (used for position ids in padding-free
      training). Sequences are never cut across packed rows.
    - `"bfd_split"`: like `"bfd"`, but rows longer than `seq_length` are split into `seq_length`-sized chunks
      instead of being truncated, so no token is lost.
    - `"wrapped"`: all rows are concatenated and cut into consecutive chunks of `seq_length` (the last chunk of each
      batch may be shorter). No `seq_lengths` column is added.

    Args:
        dataset (`Dataset`, `DatasetDict`, `IterableDataset` or `IterableDatasetDict`):
            Tokenized dataset to pack.
        seq_length (`int`):
            Maximum length of a packed row.
        strategy (`str`, *optional*, defaults to `"bfd"`):
            One of `"bfd"`, `"bfd_split"` or `"wrapped"`.
        map_kwargs (`dict`, *optional*):
            Extra keyword arguments forwarded to `dataset.map` (e.g. `num_proc`, `batch_size`).

    Returns:
        The packed dataset, with the same format (e.g. `"torch"`) as the input; `seq_lengths` is added to the
        formatted columns.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> dataset = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]})
    >>> pack_dataset(dataset, 4, "bfd")[:]
    {'input_ids': [[6, 7, 8, 9], [1, 2, 3, 10], [4, 5]], 'seq_lengths': [[4], [3, 1], [2]]}
    >>> pack_dataset(dataset, 4, "wrapped")[:]
    {'input_ids': [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]}
    ```
    """
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"Invalid packing strategy {strategy!r}; expected one of {list(PACKING_STRATEGIES)}.")
    if not isinstance(seq_length, int) or isinstance(seq_length, bool) or seq_length < 1:
        raise ValueError(f"`seq_length` must be a positive integer, found {seq_length!r}.")
    if strategy == "wrapped":
        return _map_arrow(dataset, _pack_wrapped, {"seq_length": seq_length}, map_kwargs, ())
    fn_kwargs = {"seq_length": seq_length, "split": strategy == "bfd_split"}
    return _map_arrow(dataset, _pack_bfd, fn_kwargs, map_kwargs, ("seq_lengths",))


def _truncate_table(examples: pa.Table, max_length: int) -> pa.Table:
    arrays = []
    for name in examples.column_names:
        column = examples.column(name)
        if _is_list_type(column.type):
            column = pc.list_slice(column, 0, max_length)
        arrays.append(column)
    return pa.Table.from_arrays(arrays, names=examples.column_names)


def truncate_dataset(dataset: DatasetType, max_length: int, map_kwargs: dict[str, Any] | None = None) -> DatasetType:
    """Truncate every list column of a dataset (e.g. `input_ids`, `completion_mask`) to `max_length` elements.

    Non-list columns are left untouched. The dataset keeps its format.

    Args:
        dataset (`Dataset`, `DatasetDict`, `IterableDataset` or `IterableDatasetDict`):
            Dataset to truncate.
        max_length (`int`):
            Maximum number of elements kept at the start of each list.
        map_kwargs (`dict`, *optional*):
            Extra keyword arguments forwarded to `dataset.map`.

    Returns:
        The truncated dataset.

    Example:
    ```python
    >>> from datasets import Dataset
    >>> dataset = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "label": [0, 1]})
    >>> truncate_dataset(dataset, 2)[:]
    {'input_ids': [[1, 2], [4, 5]], 'label': [0, 1]}
    ```
    """
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 0:
        raise ValueError(f"`max_length` must be a non-negative integer, found {max_length!r}.")
    return _map_arrow(dataset, _truncate_table, {"max_length": max_length}, map_kwargs, ())


# ----------------------------------------------------------------------------------------------------------------
# Misc helpers
# ----------------------------------------------------------------------------------------------------------------


def prepare_multimodal_messages(messages: list[dict[str, Any]], images: list | None = None) -> list[dict[str, Any]]:
    """Convert messages to the typed-content format used by vision-language processors and attach the images.

    String contents become `[{"type": "text", "text": ...}]` for system, developer, user, assistant and tool
    messages. The first user message with string content additionally gets one `{"type": "image"}` placeholder per
    image, before its text. Finally every image placeholder without an image (outside tool messages) receives the
    next image of `images`, in order. The input messages are not modified.

    Args:
        messages (`list[dict[str, Any]]`):
            Conversation to convert.
        images (`list`, *optional*):
            Images (e.g. `PIL.Image.Image`) to insert.

    Returns:
        `list[dict[str, Any]]`: The converted messages.

    Raises:
        ValueError: If a message has an unknown role, or the number of image placeholders does not match the number
            of images.

    Example:
    ```python
    >>> prepare_multimodal_messages([{"role": "user", "content": "What?"}], images=["IMG"])
    [{'role': 'user', 'content': [{'type': 'image', 'image': 'IMG'}, {'type': 'text', 'text': 'What?'}]}]
    ```
    """
    images = list(images) if images is not None else []
    # Copy the containers only: images may be large objects that should not be deep-copied.
    converted = []
    placeholders_added = False
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ALLOWED_ROLES:
            raise ValueError(
                f"Message {index} has role {role!r}, but the role of every message must be one of "
                f"{list(ALLOWED_ROLES)}."
            )
        message = dict(message)
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if role == "user" and not placeholders_added:
                parts = [{"type": "image"} for _ in images] + parts
                placeholders_added = True
            message["content"] = parts
        elif isinstance(content, list):
            message["content"] = [dict(part) if isinstance(part, dict) else part for part in content]
        converted.append(message)

    next_image = 0
    missing = 0
    for message in converted:
        if message["role"] == "tool" or not isinstance(message.get("content"), list):
            continue
        for part in message["content"]:
            if isinstance(part, dict) and part.get("type") == "image" and part.get("image") is None:
                if next_image < len(images):
                    part["image"] = images[next_image]
                    next_image += 1
                else:
                    missing += 1
    if missing or next_image != len(images):
        raise ValueError(
            f"The messages contain {next_image + missing} image placeholder(s) to fill but {len(images)} image(s) "
            "were given. Provide exactly one image per `{'type': 'image'}` placeholder (or let this function add "
            "the placeholders by using string contents)."
        )
    return converted


def common_prefix_length(ids: list[int], other_ids: list[int]) -> int:
    """Return the number of leading elements shared by two sequences.

    Args:
        ids (`list[int]`):
            First sequence of token ids.
        other_ids (`list[int]`):
            Second sequence of token ids.

    Returns:
        `int`: Length of the longest common prefix.

    Example:
    ```python
    >>> common_prefix_length([1, 2, 3, 4], [1, 2, 5])
    2
    ```
    """
    limit = min(len(ids), len(other_ids))
    index = 0
    while index < limit and ids[index] == other_ids[index]:
        index += 1
    return index

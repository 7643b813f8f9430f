"""Dataset types and format types: column names, detection and validation of the format a trainer expects.

Implementation module of `trl.data_utils` (import the public names from there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict


DatasetType = TypeVar("DatasetType", Dataset, DatasetDict, IterableDataset, IterableDatasetDict)


def _filter_map_kwargs(dataset: Any, map_kwargs: dict[str, Any]) -> dict[str, Any]:
    # `IterableDataset.map` does not accept the arguments that only make sense for materialised datasets.
    if isinstance(dataset, (IterableDataset, IterableDatasetDict)):
        unsupported = {"num_proc", "desc", "load_from_cache_file", "keep_in_memory", "cache_file_name"}
        unsupported |= {"writer_batch_size", "new_fingerprint", "with_rank", "suffix_template", "disable_nullable"}
        return {key: value for key, value in map_kwargs.items() if key not in unsupported}
    return dict(map_kwargs)


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


# Columns that hold either plain text (a string) or a conversation (a list of messages).
_TEXT_OR_MESSAGES_COLUMNS = ("text", "messages", "prompt", "completion", "chosen", "rejected")


def check_single_format(dataset: Any, dataset_name: str = "train") -> None:
    """Refuse a dataset that mixes plain-text rows and conversational rows.

    Built from a list of dicts, such a dataset holds a string column (`text`, or a string `prompt`) that is empty
    (None) on the conversational rows and a messages column that is empty on the plain-text rows; the format is
    detected from the first row, so the other rows would fail later with an unclear type error. Only materialised
    `datasets.Dataset`s are inspected (through Arrow validity masks; no row is decoded until an example is shown).

    Args:
        dataset: The dataset to check (anything else than a `datasets.Dataset` is accepted as is).
        dataset_name: Name of the split, for the message.

    Raises:
        ValueError: Naming both formats with one example row of each.
    """
    if not isinstance(dataset, Dataset) or len(dataset) == 0:
        return
    features = dataset.features
    text_columns, message_columns = [], []
    for name in _TEXT_OR_MESSAGES_COLUMNS:
        feature = features.get(name)
        if getattr(feature, "dtype", None) in ("string", "large_string"):
            text_columns.append(name)
        elif feature is not None and (not hasattr(feature, "dtype") or feature.dtype == "list"):
            message_columns.append(name)
    if not text_columns or not message_columns:
        return
    import pyarrow.compute as pc

    table = dataset.select_columns(text_columns + message_columns).with_format("arrow")[:]

    def any_valid(columns: list[str]):
        masks = [pc.is_valid(table.column(name)) for name in columns]
        combined = masks[0]
        for mask in masks[1:]:
            combined = pc.or_(combined, mask)
        return combined

    has_text, has_messages = any_valid(text_columns), any_valid(message_columns)
    text_only = pc.and_(has_text, pc.invert(has_messages))
    messages_only = pc.and_(has_messages, pc.invert(has_text))
    if not (pc.any(text_only).as_py() and pc.any(messages_only).as_py()):
        return
    text_row = pc.index(text_only, True).as_py()
    message_row = pc.index(messages_only, True).as_py()

    def shown(row: int) -> str:
        example = {key: value for key, value in dataset[row].items() if value is not None}
        return str(example)[:300]

    raise ValueError(
        f"The {dataset_name} dataset mixes two formats: plain-text rows (columns {text_columns}), e.g. row "
        f"{text_row}: {shown(text_row)}, and conversational rows (columns {message_columns}), e.g. row {message_row}: "
        f"{shown(message_row)}. Use one format for every row: convert the plain-text rows to messages (or render "
        "the conversations to text with the chat template) before training."
    )


_IMAGE_COLUMNS = ("image", "images")


def check_no_images(dataset: Any, dataset_name: str = "train") -> None:
    """Refuse a dataset whose `image` / `images` column holds images: the trainers here train text-only models and
    would otherwise drop them without a word.

    Args:
        dataset: The dataset to check (anything else than a `datasets.Dataset` is accepted as is).
        dataset_name: Name of the split, for the message.

    Raises:
        ValueError: Naming the column and the first row with an image.
    """
    if not isinstance(dataset, Dataset) or len(dataset) == 0:
        return
    import pyarrow.compute as pc

    for name in _IMAGE_COLUMNS:
        if name not in dataset.column_names:
            continue
        column = dataset.select_columns([name]).with_format("arrow")[:].column(name)
        present = pc.is_valid(column)
        if name == "images" and getattr(dataset.features[name], "dtype", None) != "string":
            present = pc.and_(present, pc.greater(pc.fill_null(pc.list_value_length(column), 0), 0))
        if not pc.any(present).as_py():
            continue
        row = pc.index(present, True).as_py()
        raise ValueError(
            f"The {dataset_name} dataset has images in its {name!r} column (row {row} and maybe others), but the "
            "model is trained as a text-only language model, so the images would be silently ignored. Remove the "
            f"column (dataset.remove_columns({name!r})) to train on the text alone, or train a vision-language model "
            "with a trainer and processor that take images."
        )

"""Preference examples: extracting the shared prompt of `"chosen"` and `"rejected"`, and unpairing preference datasets
into `{"prompt", "completion", "label"}` rows.

Implementation module of `trl.data_utils` (import the public names from there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .conversational import is_conversational
from .formats import DatasetType, _filter_map_kwargs, get_dataset_column_names


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
    if not (
        (isinstance(chosen, str) and isinstance(rejected, str))
        or (isinstance(chosen, list) and isinstance(rejected, list))
    ):
        raise TypeError(
            "Preference data needs `chosen` and `rejected` of the same kind: both strings (standard) or both lists "
            f"of messages (conversational); got {type(chosen).__name__} and {type(rejected).__name__} "
            f"(chosen={str(chosen)[:80]!r}, rejected={str(rejected)[:80]!r})."
        )
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

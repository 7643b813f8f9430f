"""Dataset utilities: format detection, chat-template rendering, prompt extraction, unpairing, packing, truncation.

A dataset is either *standard* (values are plain strings) or *conversational* (values are lists of
`{"role": ..., "content": ...}` messages). The functions below work on single examples (to be used with
`dataset.map`) or on whole `Dataset` / `IterableDataset` objects, as documented on each function.

This module is the public front; the implementations live in `trl._data`, one module per concern: `formats` (dataset
types, column names, format detection and validation), `conversational` (message lists: detection, ChatML conversion,
vision-language typed content), `chat_rendering` (`apply_chat_template`), `preference` (prompt extraction,
unpairing) and `packing` (packing and truncation).
"""

from __future__ import annotations

# Re-exported: the public names of this module, implemented in `trl._data`.
from ._data.chat_rendering import apply_chat_template, maybe_apply_chat_template  # noqa: F401
from ._data.conversational import (  # noqa: F401
    ALLOWED_ROLES,
    is_conversational,
    is_conversational_from_value,
    maybe_convert_to_chatml,
    prepare_multimodal_messages,
)
from ._data.formats import (  # noqa: F401
    DATASET_FORMATS,
    DatasetType,
    detect_dataset_format,
    get_dataset_column_names,
    validate_dataset_format,
)
from ._data.packing import PACKING_STRATEGIES, pack_dataset, truncate_dataset  # noqa: F401
from ._data.packing import _pack_bfd as _pack_bfd  # private, but named by the API contract
from ._data.packing import _pack_wrapped as _pack_wrapped  # private, but named by the API contract
from ._data.preference import (  # noqa: F401
    extract_prompt,
    maybe_extract_prompt,
    maybe_unpair_preference_dataset,
    unpair_preference_dataset,
)


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


# The public functions (and `DatasetType`) are documented, pickled and shown by `help()` as `trl.data_utils.<name>`,
# their home in the API contract, wherever their code lives.
for _name, _value in list(globals().items()):
    if not _name.startswith("_") and getattr(_value, "__module__", "").startswith("trl._data."):
        _value.__module__ = __name__
del _name, _value

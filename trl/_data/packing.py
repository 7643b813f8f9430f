"""Packing and truncation of tokenized datasets (pyarrow, vectorised).

Implementation module of `trl.data_utils` (import the public names from there).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict, List, Value

from .formats import DatasetType, _filter_map_kwargs


PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")


def check_packing_strategy(strategy: str) -> None:
    """Raise TRL's error for a packing strategy other than those in `PACKING_STRATEGIES`.

    Args:
        strategy: The requested strategy.

    Raises:
        ValueError: For an unknown strategy (TRL's sentence first, then what each strategy does).
    """
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(
            f"Invalid packing strategy '{strategy}', must be one of {PACKING_STRATEGIES}. 'bfd' packs whole "
            "sequences best-fit decreasing (truncating overlong ones), 'bfd_split' splits overlong ones instead, "
            "'wrapped' concatenates everything and cuts it into rows."
        )


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
    check_packing_strategy(strategy)
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

"""Property-based tests (hypothesis) for `pack_dataset` and `truncate_dataset`."""

from collections import Counter

from datasets import Dataset, Features, List, Value
from hypothesis import given, settings
from hypothesis import strategies as st

from trl.data_utils import pack_dataset, truncate_dataset


PROPERTY_SETTINGS = settings(max_examples=50, deadline=None)

# Lengths of the original sequences; each token is made unique (row * 1000 + position) so that pieces can be traced
# back to their source sequence.
row_lengths = st.lists(st.integers(min_value=0, max_value=24), min_size=0, max_size=30)
seq_lengths = st.integers(min_value=1, max_value=16)
batch_sizes = st.sampled_from([1, 3, 7, 1000])


def make_rows(lengths):
    return [[row * 1000 + position for position in range(length)] for row, length in enumerate(lengths)]


def aux_of(token):
    # Deterministic auxiliary value per token: lets us check that auxiliary columns moved with their tokens.
    return (token * 7 + 3) % 5


def make_dataset(lengths):
    rows = make_rows(lengths)
    return rows, Dataset.from_dict(
        {
            "input_ids": rows,
            "completion_mask": [[aux_of(token) for token in row] for row in rows],
            "assistant_masks": [[token % 2 for token in row] for row in rows],
        }
    )


def batches(items, batch_size):
    return [items[start : start + batch_size] for start in range(0, len(items), batch_size)]


def check_aligned(packed):
    for ids, mask, assistant in zip(
        packed["input_ids"], packed["completion_mask"], packed["assistant_masks"], strict=True
    ):
        assert mask == [aux_of(token) for token in ids]
        assert assistant == [token % 2 for token in ids]


def split_by_lengths(row, lengths):
    pieces, start = [], 0
    for length in lengths:
        pieces.append(row[start : start + length])
        start += length
    return pieces


@PROPERTY_SETTINGS
@given(lengths=row_lengths, seq_length=seq_lengths, batch_size=batch_sizes)
def test_bfd_properties(lengths, seq_length, batch_size):
    rows, dataset = make_dataset(lengths)
    packed = pack_dataset(dataset, seq_length, "bfd", map_kwargs={"batch_size": batch_size})[:]

    # No token lost or duplicated beyond the truncation to seq_length.
    expected = Counter(token for row in rows for token in row[:seq_length])
    assert Counter(token for row in packed["input_ids"] for token in row) == expected
    check_aligned(packed)

    originals = {row[0]: row for row in rows if row}
    for ids, lengths_in_row in zip(packed["input_ids"], packed["seq_lengths"], strict=True):
        assert 0 < len(ids) <= seq_length
        assert sum(lengths_in_row) == len(ids)
        assert all(length > 0 for length in lengths_in_row)
        # Pieces are placed longest first.
        assert lengths_in_row == sorted(lengths_in_row, reverse=True)
        # Each piece is a whole original sequence, truncated to seq_length.
        for piece in split_by_lengths(ids, lengths_in_row):
            assert piece == originals[piece[0]][:seq_length]

    # Packing happens inside each map batch; within a batch no two packed rows could have been merged
    # (a new row is only opened when nothing fits, which holds for any best-fit packing).
    non_empty_per_batch = [sum(1 for row in batch if row) for batch in batches(rows, batch_size)]
    assert sum(non_empty_per_batch) == sum(len(row) for row in packed["seq_lengths"])
    start = 0
    for batch in batches(rows, batch_size):
        pieces = sum(1 for row in batch if row)
        group, taken = [], 0
        while taken < pieces:
            group.append(len(packed["input_ids"][start]))
            taken += len(packed["seq_lengths"][start])
            start += 1
        assert taken == pieces
        for i in range(len(group)):
            for j in range(i + 1, len(group)):
                assert group[i] + group[j] > seq_length


def reference_bfd(rows, seq_length, split):
    """Straightforward quadratic best-fit decreasing, used as an oracle for the segment-tree implementation."""
    pieces = []
    for row in rows:
        if split:
            pieces += [row[start : start + seq_length] for start in range(0, len(row), seq_length)]
        elif row:
            pieces.append(row[:seq_length])
    pieces.sort(key=len, reverse=True)  # stable: equal lengths keep their order
    bins = []
    for piece in pieces:
        fitting = [index for index, packed in enumerate(bins) if sum(map(len, packed)) + len(piece) <= seq_length]
        if fitting:
            # Least remaining room; the earliest created bin among equals.
            best = min(fitting, key=lambda index: (seq_length - sum(map(len, bins[index])), index))
            bins[best].append(piece)
        else:
            bins.append([piece])
    return {
        "input_ids": [[token for piece in packed for token in piece] for packed in bins],
        "seq_lengths": [[len(piece) for piece in packed] for packed in bins],
    }


@PROPERTY_SETTINGS
@given(lengths=row_lengths, seq_length=seq_lengths, batch_size=batch_sizes, split=st.booleans())
def test_bfd_matches_reference(lengths, seq_length, batch_size, split):
    rows = make_rows(lengths)
    dataset = Dataset.from_dict({"input_ids": rows}, features=Features({"input_ids": List(Value("int64"))}))
    strategy = "bfd_split" if split else "bfd"
    packed = pack_dataset(dataset, seq_length, strategy, map_kwargs={"batch_size": batch_size})[:]
    expected = {"input_ids": [], "seq_lengths": []}
    for batch in batches(rows, batch_size):
        reference = reference_bfd(batch, seq_length, split)
        expected["input_ids"] += reference["input_ids"]
        expected["seq_lengths"] += reference["seq_lengths"]
    assert packed == expected


@PROPERTY_SETTINGS
@given(lengths=row_lengths, seq_length=seq_lengths, batch_size=batch_sizes)
def test_bfd_split_properties(lengths, seq_length, batch_size):
    rows, dataset = make_dataset(lengths)
    packed = pack_dataset(dataset, seq_length, "bfd_split", map_kwargs={"batch_size": batch_size})[:]

    # Nothing is truncated: exactly the input tokens come out.
    assert Counter(token for row in packed["input_ids"] for token in row) == Counter(t for row in rows for t in row)
    check_aligned(packed)

    originals = {row[0]: row for row in rows if row}
    chunks = []
    for ids, lengths_in_row in zip(packed["input_ids"], packed["seq_lengths"], strict=True):
        assert 0 < len(ids) <= seq_length
        assert sum(lengths_in_row) == len(ids)
        assert lengths_in_row == sorted(lengths_in_row, reverse=True)
        for piece in split_by_lengths(ids, lengths_in_row):
            # A piece is a contiguous, seq_length-aligned chunk of one original sequence.
            row_index, position = divmod(piece[0], 1000)
            assert position % seq_length == 0
            original = rows[row_index]
            assert piece == original[position : position + seq_length]
            chunks.append(piece[0])
    # Every chunk of every sequence appears exactly once.
    expected_chunks = [row[start] for row in originals.values() for start in range(0, len(row), seq_length)]
    assert sorted(chunks) == sorted(expected_chunks)


@PROPERTY_SETTINGS
@given(lengths=row_lengths, seq_length=seq_lengths, batch_size=batch_sizes)
def test_wrapped_properties(lengths, seq_length, batch_size):
    rows, dataset = make_dataset(lengths)
    packed = pack_dataset(dataset, seq_length, "wrapped", map_kwargs={"batch_size": batch_size})[:]
    assert set(packed) == {"input_ids", "completion_mask", "assistant_masks"}

    # Order is preserved: concatenating the packed rows gives back the concatenated input.
    assert [token for row in packed["input_ids"] for token in row] == [token for row in rows for token in row]
    check_aligned(packed)
    assert all(0 < len(row) <= seq_length for row in packed["input_ids"])
    # Only the last chunk of each map batch may be short.
    expected_row_lengths = []
    for batch in batches(rows, batch_size):
        total = sum(len(row) for row in batch)
        expected_row_lengths += [seq_length] * (total // seq_length) + (
            [total % seq_length] if total % seq_length else []
        )
    assert [len(row) for row in packed["input_ids"]] == expected_row_lengths


@PROPERTY_SETTINGS
@given(
    lengths=st.lists(
        st.integers(min_value=0, max_value=24), min_size=1, max_size=30
    ),  # to_iterable_dataset needs 1 row
    seq_length=seq_lengths,
    strategy=st.sampled_from(["bfd", "bfd_split", "wrapped"]),
)
def test_iterable_dataset_packs_like_dataset(lengths, seq_length, strategy):
    _, dataset = make_dataset(lengths)
    expected = pack_dataset(dataset, seq_length, strategy).to_list()
    assert list(pack_dataset(dataset.to_iterable_dataset(), seq_length, strategy)) == expected


@PROPERTY_SETTINGS
@given(lengths=row_lengths, max_length=st.integers(min_value=0, max_value=30))
def test_truncate_properties(lengths, max_length):
    rows, dataset = make_dataset(lengths)
    dataset = dataset.add_column("label", list(range(len(rows))))
    truncated = truncate_dataset(dataset, max_length)[:]

    assert truncated["input_ids"] == [row[:max_length] for row in rows]
    assert truncated["label"] == list(range(len(rows)))
    check_aligned(truncated)
    # Tokens kept: exactly the first max_length of each sequence, none invented.
    assert Counter(t for row in truncated["input_ids"] for t in row) == Counter(
        t for row in rows for t in row[:max_length]
    )

"""Sampling and batch splitting: repeated-index samplers for groups of completions (GRPO, RLOO) and splitting or
shuffling dictionaries of per-example tensors and lists."""

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


class RepeatSampler(Sampler):
    """Sampler that repeats every index and every batch, as needed to build groups of completions (GRPO).

    Indices are (optionally) shuffled, cut into batches of `batch_size` unique indices (an incomplete last batch is
    dropped), then each batch is emitted `repeat_count` times, and inside it every index `mini_repeat_count` times in
    a row.

    Args:
        data_source: Sized collection being sampled.
        mini_repeat_count: Consecutive repetitions of each index.
        batch_size: Number of unique indices per batch.
        repeat_count: Number of times each batch is repeated.
        shuffle: Shuffle the indices once per iteration.
        seed: Seed of the shuffling generator, for reproducible orders.

    Example:
        >>> list(RepeatSampler(["a", "b", "c", "d", "e"], mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=False))
        [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    """

    def __init__(
        self,
        data_source: Any,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
    ):
        self.data_source = data_source
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.num_samples = len(data_source)
        self.shuffle = shuffle
        self.seed = seed
        if shuffle:
            self.generator = torch.Generator()
            if seed is not None:
                self.generator.manual_seed(seed)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=self.generator).tolist()
        else:
            order = list(range(self.num_samples))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        batches = [b for b in batches if len(b) == self.batch_size]
        for batch in batches:
            for _ in range(self.repeat_count):
                for index in batch:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        full = (self.num_samples // self.batch_size) * self.batch_size
        return full * self.mini_repeat_count * self.repeat_count


class RepeatedIterableDataset(torch.utils.data.IterableDataset):
    """Streaming counterpart of [`RepeatSampler`]: iterates a (possibly unbounded) dataset and repeats its examples.

    Examples are read `batch_size` at a time (an incomplete last batch is dropped); each batch is emitted
    `repeat_count` times and inside it every example `mini_repeat_count` times in a row. `set_epoch` is forwarded to
    the wrapped dataset, so a shuffled `datasets.IterableDataset` is reshuffled every epoch. The wrapper is picklable
    (a class, not a generator closure).
    """

    def __init__(self, dataset: Iterable[dict], mini_repeat_count: int, batch_size: int = 1, repeat_count: int = 1):
        super().__init__()
        self.dataset = dataset
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def features(self) -> Any:
        return getattr(self.dataset, "features", None)

    @property
    def column_names(self) -> Any:
        return getattr(self.dataset, "column_names", None)

    def __iter__(self) -> Iterator[dict]:
        batch = []
        for example in self.dataset:
            batch.append(example)
            if len(batch) == self.batch_size:
                for _ in range(self.repeat_count):
                    for item in batch:
                        for _ in range(self.mini_repeat_count):
                            yield item
                batch = []


def repeat_iterable_dataset(
    dataset: Iterable[dict],
    mini_repeat_count: int,
    batch_size: int = 1,
    repeat_count: int = 1,
) -> RepeatedIterableDataset:
    """Streaming counterpart of [`RepeatSampler`] for iterable datasets.

    Examples are read `batch_size` at a time (an incomplete last batch is dropped); each batch is emitted
    `repeat_count` times and inside it every example `mini_repeat_count` times in a row.

    Args:
        dataset: Iterable of examples, typically a `datasets.IterableDataset`.
        mini_repeat_count: Consecutive repetitions of each example.
        batch_size: Number of unique examples per batch.
        repeat_count: Number of times each batch is repeated.

    Returns:
        A [`RepeatedIterableDataset`] (a `torch.utils.data.IterableDataset`) yielding the repeated examples; its
        `set_epoch` reaches the wrapped dataset.
    """
    return RepeatedIterableDataset(dataset, mini_repeat_count, batch_size, repeat_count)


def _batch_length(values: Iterable[Any]) -> int:
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
        if isinstance(value, (list, tuple)):
            return len(value)
    raise ValueError("Expected at least one tensor (with a batch dimension) or list in the dictionary, found none.")


def split_tensor_dict(tensor_dict: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Split every tensor/list in a dictionary into `num_chunks` equal parts along the first dimension.

    `None` values and 0-d tensors are copied unchanged into every chunk.

    Args:
        tensor_dict: Mapping of names to tensors of shape `(batch, ...)`, lists of length `batch`, `None` or scalars.
        num_chunks: Number of chunks; `batch // num_chunks` items go into each.

    Returns:
        List of `num_chunks` dictionaries with the same keys.
    """
    chunk_size = _batch_length(tensor_dict.values()) // num_chunks
    chunks = []
    for i in range(num_chunks):
        chunk = {}
        for key, value in tensor_dict.items():
            if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0):
                chunk[key] = value
            elif isinstance(value, (torch.Tensor, list, tuple)):
                chunk[key] = value[i * chunk_size : (i + 1) * chunk_size]
            else:
                chunk[key] = value
        chunks.append(chunk)
    return chunks


def shuffle_sequence_dict(seq_dict: dict[str, Any]) -> dict[str, Any]:
    """Shuffle every tensor/list of a dictionary along the first dimension with one shared random permutation.

    `None` values and 0-d tensors are kept as they are.

    Args:
        seq_dict: Mapping of names to tensors of shape `(batch, ...)`, lists of length `batch`, `None` or scalars.

    Returns:
        New dictionary with permuted entries.
    """
    permutation = torch.randperm(_batch_length(seq_dict.values()))
    order = permutation.tolist()
    shuffled = {}
    for key, value in seq_dict.items():
        if value is None or (isinstance(value, torch.Tensor) and value.dim() == 0):
            shuffled[key] = value
        elif isinstance(value, torch.Tensor):
            shuffled[key] = value[permutation.to(value.device)]
        elif isinstance(value, (list, tuple)):
            shuffled[key] = type(value)(value[i] for i in order)
        else:
            shuffled[key] = value
    return shuffled

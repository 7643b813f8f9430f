"""Reference log-probabilities of a frozen reference, computed once per example when training sees it again.

DPO, KTO and BCO score every batch with the reference model. The reference does not change while training (unless
`sync_ref_model` updates it) and draws no random numbers in eval mode, so an example's reference values are the same
every time it comes back: with several epochs, each later epoch would repeat the first one's reference forward
passes. [`ReferenceCache`] keeps each example's values under a digest of its tokens; a batch whose examples are all
known skips the reference pass, any other batch is scored as usual and remembered.

A remembered value was computed in the batch the example first came in; a recomputed one in another batch. Both are
the reference's value for that example up to float rounding of the batch's layout (the same difference a padded and
a packed batch have), so training against either matches TRL within the parity suite's tolerances.
"""

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch


class ReferenceCache:
    """Reference values of examples seen before, keyed by a digest of each example's tokens.

    Values are kept as Python floats (exactly the float32 values computed) with each column's dtype, and handed back as
    tensors on the device of the batch they are asked for.
    """

    def __init__(self):
        self._values: dict[bytes, tuple[float, ...]] = {}
        self._columns: tuple[str, ...] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._values)

    def values_for(
        self,
        keys: Sequence[bytes],
        device: torch.device,
        compute: Callable[[], dict[str, torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        """The reference values of a batch whose examples have the digests `keys`.

        Args:
            keys: One digest per example (see [`row_digests`]).
            device: Where the returned tensors go.
            compute: Computes `{column: (len(keys),) tensor}` for the whole batch; called when any example is new.

        Returns:
            `{column: (len(keys),) tensor}`.
        """
        known = [self._values.get(key) for key in keys]
        if self._columns is not None and keys and all(value is not None for value in known):
            self.hits += 1
            return {
                name: torch.tensor([value[i] for value in known], dtype=self._dtypes[name], device=device)
                for i, name in enumerate(self._columns)
            }
        self.misses += 1
        computed = compute()
        columns = tuple(computed)
        if self._columns is None:
            self._columns = columns
            self._dtypes = {name: tensor.dtype for name, tensor in computed.items()}
        if columns == self._columns:
            rows = zip(*(computed[name].detach().cpu().tolist() for name in columns))
            for key, row in zip(keys, rows):
                self._values[key] = tuple(row)
        return computed


def row_digests(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], num_examples: int
) -> list[bytes]:
    """One digest per example of the real tokens of its rows.

    Args:
        parts: `(input_ids, attention_mask, completion_mask)` groups of rows; example `i` owns row `i` of each group,
            and row `i + num_examples`, `i + 2 * num_examples`, ... of a group with a multiple of `num_examples` rows
            (DPO's chosen rows, then its rejected rows). Padding (`attention_mask == 0`) is left out, so an example's
            digest does not depend on the batch it is padded with.
        num_examples: Examples in the batch.

    Returns:
        `num_examples` 16-byte digests.
    """
    hashers = [hashlib.blake2b(digest_size=16) for _ in range(num_examples)]
    for input_ids, attention_mask, completion_mask in parts:
        real = attention_mask.bool().cpu()
        ids, completion = input_ids.cpu(), completion_mask.cpu() if completion_mask is not None else None
        for row in range(ids.shape[0]):
            hasher = hashers[row % num_examples]
            keep = real[row]
            hasher.update(ids[row][keep].numpy().tobytes())
            if completion is not None:
                hasher.update(completion[row][keep].to(torch.uint8).numpy().tobytes())
            hasher.update(b"|")
    return [hasher.digest() for hasher in hashers]


def training_revisits_examples(args: Any, num_examples: int | None, num_processes: int) -> bool:
    """Whether a training run with `args` sees some example of a dataset of `num_examples` more than once.

    Args:
        args: The training arguments (`max_steps`, `num_train_epochs`, batch size, gradient accumulation).
        num_examples: Length of the train dataset, or None when it has none (an iterable dataset).
        num_processes: Processes sharing the data.
    """
    if not num_examples:
        return False
    if args.max_steps > 0:
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(num_processes, 1)
        return args.max_steps * per_step > num_examples
    return args.num_train_epochs > 1

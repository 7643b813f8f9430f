"""Tensor helpers: padding a list of tensors into one, flushing rows of a mask left or right, NaN-aware reductions."""

import math

import torch


def pad(
    tensors: list[torch.Tensor],
    padding_value: int = 0,
    padding_side: str = "right",
    pad_to_multiple_of: int | None = None,
) -> torch.Tensor:
    """Stack tensors of different shapes into one tensor, padding every dimension to the largest size.

    Args:
        tensors: Tensors with the same number of dimensions (sizes may differ per dimension).
        padding_value: Value written into the padded positions.
        padding_side: `"right"` puts the data at the start of each dimension, `"left"` at the end.
        pad_to_multiple_of: If set, the first dimension of the stacked items is rounded up to a multiple of it.

    Returns:
        Tensor of shape `(len(tensors), *max_shape)` with the dtype and device of the first tensor.

    Example:
        >>> pad([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], padding_side="left")
        tensor([[1, 2, 3],
                [0, 4, 5]])
    """
    if len(tensors) == 0:
        raise ValueError("`pad` expected a non-empty list of tensors, got an empty list.")
    ndim = tensors[0].dim()
    if any(t.dim() != ndim for t in tensors):
        found = sorted({t.dim() for t in tensors})
        raise ValueError(
            f"`pad` expected tensors with the same number of dimensions, found dimensions {found}. Reshape them so "
            "they all have the same rank."
        )
    if padding_side not in ("left", "right"):
        raise ValueError(f"`padding_side` must be 'left' or 'right', got {padding_side!r}.")
    output_shape = [max(t.shape[d] for t in tensors) for d in range(ndim)]
    if pad_to_multiple_of is not None and ndim > 0:
        output_shape[0] = math.ceil(output_shape[0] / pad_to_multiple_of) * pad_to_multiple_of

    output = torch.full((len(tensors), *output_shape), padding_value, dtype=tensors[0].dtype, device=tensors[0].device)
    for i, tensor in enumerate(tensors):
        if padding_side == "left":
            region = tuple(slice(size - n, size) for size, n in zip(output_shape, tensor.shape))
        else:
            region = tuple(slice(0, n) for n in tensor.shape)
        output[i][region] = tensor
    return output


def _gather_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather along dim 1 with a `(B, L)` index, broadcasting it over any trailing dimensions of `tensor`."""
    expanded = index.reshape(*index.shape, *([1] * (tensor.dim() - 2))).expand(*index.shape, *tensor.shape[2:])
    return tensor.gather(1, expanded)


def flush_left(mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Shift every row left so it starts at its first non-zero mask entry, then drop trailing all-zero columns.

    Args:
        mask: 2D mask of shape `(batch, length)`.
        *tensors: Tensors of shape `(batch, length, ...)` shifted with the same per-row offsets.

    Returns:
        The shifted mask alone when no other tensor is given, otherwise a tuple `(mask, *tensors)`.

    Example:
        >>> flush_left(torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0]]))
        tensor([[1, 1],
                [1, 0]])
    """
    if mask.dim() != 2:
        raise ValueError(f"`flush_left` expected a 2D mask of shape (batch, length), got shape {tuple(mask.shape)}.")
    _, length = mask.shape
    first_one = (mask != 0).int().argmax(dim=1)
    positions = torch.arange(length, device=mask.device)
    index = (positions.unsqueeze(0) + first_one.unsqueeze(1)) % length
    new_mask = mask.gather(1, index)
    new_tensors = [_gather_rows(t, index) for t in tensors]

    used = (new_mask != 0).any(dim=0).nonzero()
    keep = int(used.max()) + 1 if used.numel() > 0 else 0
    new_mask = new_mask[:, :keep]
    new_tensors = [t[:, :keep] for t in new_tensors]
    if not new_tensors:
        return new_mask
    return (new_mask, *new_tensors)


def flush_right(mask: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Shift every row right so it ends at its last non-zero mask entry, then drop leading all-zero columns.

    Args:
        mask: 2D mask of shape `(batch, length)`.
        *tensors: Tensors of shape `(batch, length, ...)` shifted with the same per-row offsets.

    Returns:
        The shifted mask alone when no other tensor is given, otherwise a tuple `(mask, *tensors)`.

    Example:
        >>> flush_right(torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]]))
        tensor([[1, 1],
                [0, 1]])
    """
    if mask.dim() != 2:
        raise ValueError(f"`flush_right` expected a 2D mask of shape (batch, length), got shape {tuple(mask.shape)}.")
    _, length = mask.shape
    last_one = length - 1 - (mask != 0).int().flip(dims=[1]).argmax(dim=1)
    shift = length - 1 - last_one
    positions = torch.arange(length, device=mask.device)
    index = (positions.unsqueeze(0) - shift.unsqueeze(1)) % length
    new_mask = mask.gather(1, index)
    new_tensors = [_gather_rows(t, index) for t in tensors]

    used = (new_mask != 0).any(dim=0).nonzero()
    start = int(used.min()) if used.numel() > 0 else length
    new_mask = new_mask[:, start:]
    new_tensors = [t[:, start:] for t in new_tensors]
    if not new_tensors:
        return new_mask
    return (new_mask, *new_tensors)


def nanstd(tensor: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased standard deviation that ignores NaN entries.

    Args:
        tensor: Input tensor.
        dim: Dimension to reduce; `None` reduces over every element.
        keepdim: Keep the reduced dimension with size 1.

    Returns:
        The standard deviation (NaN where fewer than two values are present).
    """
    valid = ~torch.isnan(tensor)
    if dim is None:
        mean = torch.nanmean(tensor)
        count = valid.sum()
        squared = torch.nanmean((tensor - mean) ** 2)
        if keepdim:
            shape = [1] * tensor.dim()
            count, squared = count.reshape(shape), squared.reshape(shape)
    else:
        mean = torch.nanmean(tensor, dim=dim, keepdim=True)
        count = valid.sum(dim=dim, keepdim=keepdim)
        squared = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=keepdim)
    variance = squared * count / (count - 1)
    return torch.sqrt(variance)


def nanmin(tensor: torch.Tensor) -> torch.Tensor:
    """Smallest non-NaN value of `tensor` (NaN when every entry is NaN)."""
    valid = tensor[~torch.isnan(tensor)]
    if valid.numel() == 0:
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return valid.min()


def nanmax(tensor: torch.Tensor) -> torch.Tensor:
    """Largest non-NaN value of `tensor` (NaN when every entry is NaN)."""
    valid = tensor[~torch.isnan(tensor)]
    if valid.numel() == 0:
        return torch.tensor(float("nan"), dtype=tensor.dtype, device=tensor.device)
    return valid.max()

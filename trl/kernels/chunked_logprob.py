"""`ChunkedLogProbFunction`: TRL's autograd function for the log-probabilities (and optional per-row statistics) of
target tokens under a linear LM head, without the `(rows, vocab)` logits of all rows at once.

It is an adapter over this package's fused head (`linear_log_softmax._LinearLogSoftmax`): the same chunked forward and
recomputing backward, with TRL's argument order and outputs. TRL exposes it as `trl.kernels.ChunkedLogProbFunction`
and as `trl.trainer.utils._ChunkedLogProbFunction`.
"""

from __future__ import annotations

import torch

from .linear_log_softmax import _LinearLogSoftmax, _transform_logits


# Token rows per tile in TRL's kernel; with `chunk_size` vocabulary entries per tile it sets the working set here too.
TOKEN_CHUNK_SIZE = 4096
# The statistics `outputs` may name, in the order they are returned after the log-probabilities.
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _statistics_fn(temperature: float, logit_scale: float, softcap: float | None, names: tuple[str, ...]):
    """Per-row statistics of the transformed logits `z` of a chunk (no gradient), as `_LinearLogSoftmax` collects
    them: `log_sum_sq_probs = log sum_v p_v**2`, `mean_logits = mean_v z_v`, `is_top1 = (argmax_v z_v == target)`
    (the first maximum wins a tie)."""

    def stats(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        z = _transform_logits(logits, torch.float32, logit_scale, softcap) / temperature
        out = {}
        if "log_sum_sq_probs" in names:
            out["log_sum_sq_probs"] = torch.logsumexp(2 * torch.log_softmax(z, dim=-1), dim=-1)
        if "mean_logits" in names:
            out["mean_logits"] = z.mean(dim=-1)
        if "is_top1" in names:
            out["is_top1"] = z.argmax(dim=-1) == targets
        return out

    return stats


class ChunkedLogProbFunction(torch.autograd.Function):
    """Log-probability of `targets` under `softmax(transform(hidden @ weight.T + bias) / temperature)`, row by row.

    `transform` multiplies by `logit_scale`, then soft-caps to `c * tanh(z / c)` when `final_logit_softcapping = c` is
    set. The forward processes blocks of rows and keeps per row only the log-normaliser (and the entropy); the backward
    recomputes each block's logits. Gradients flow to `hidden`, `weight` and `bias` through the log-probabilities and
    the entropy; the other statistics carry none.

    Use it through `apply`:

    ```python
    logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1 = ChunkedLogProbFunction.apply(
        hidden, weight, bias, targets, temperature, chunk_size
    )
    ```

    Args (of `apply`):
        hidden: `(N, H)` final hidden states.
        weight: `(V, H)` LM-head weight.
        bias: `(V,)` LM-head bias or `None`.
        targets: `(N,)` token ids to score.
        temperature: The transformed logits are divided by it.
        chunk_size: Vocabulary entries per tile in TRL's kernel; here the rows of a block are chosen so that a block
            holds about `TOKEN_CHUNK_SIZE * chunk_size` logits.
        final_logit_softcapping: Soft cap `c` of the logits, or `None`.
        logit_scale: Factor applied to the logits first.
        outputs: Which of `OPTIONAL_OUTPUTS` to compute; the others are returned as `None`.

    Returns:
        `(logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1)`, each `(N,)` (float32; `is_top1` bool) or `None`.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = OPTIONAL_OUTPUTS,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        unknown = set(outputs) - set(OPTIONAL_OUTPUTS)
        if unknown:
            raise ValueError(f"outputs must be taken from {OPTIONAL_OUTPUTS}; got {sorted(unknown)}.")
        scale = float(logit_scale)
        cap = None if final_logit_softcapping is None else float(final_logit_softcapping)
        stat_names = tuple(name for name in OPTIONAL_OUTPUTS[1:] if name in outputs)
        stats_fn = _statistics_fn(float(temperature), scale, cap, stat_names) if stat_names else None
        max_rows = max(1, TOKEN_CHUNK_SIZE * int(chunk_size) // max(weight.shape[0], 1))
        names: list[str] = []
        logps, entropy, *values = _LinearLogSoftmax.forward(
            ctx,
            hidden,
            weight,
            bias,
            targets.long(),
            float(temperature),
            "entropy" in outputs,
            stats_fn,
            names,
            max_rows,
            scale,
            cap,
        )
        found = dict(zip(names, values, strict=True))
        if "entropy" in outputs:
            found["entropy"] = entropy
        # float32 results whatever the compute dtype (is_top1 stays bool), as TRL returns them
        results = [found.get(name) for name in OPTIONAL_OUTPUTS]
        results = [r.float() if r is not None and r.is_floating_point() else r for r in results]
        return (logps.float(), *results)

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_):
        grad_hidden, grad_weight, grad_bias, *_ = _LinearLogSoftmax.backward(ctx, grad_logprobs, grad_entropy)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None

"""Pure tensor functions of PPO: per-token KL, token rewards, whitening, GAE and the clipped losses.

No trainer state here: each function is tested against hand computations in `tests/experimental/test_ppo_math.py`
and called by [`PPOTrainer`]. Masks are boolean, True on the positions that count.
"""

from typing import NamedTuple

import torch


# Stored in place of the log-probability of a padding position (so that a policy/reference difference is 0 there).
INVALID_LOGPROB = 1.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` weighted by `mask` (bool or float weights), over dimension `axis` or over everything.

    NaN where the mask sums to 0, as in TRL (this is TRL's `masked_mean` of `trl.experimental.ppo.ppo_trainer`).
    """
    mask = mask.to(values.dtype)
    if axis is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(axis) / mask.sum(axis)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` weighted by `mask`, with Bessel's correction `n / (n - 1)` (n = the mask's sum) when
    `unbiased` (TRL's `masked_var`: NaN for a single unmasked value, or an empty mask when not `unbiased`).

    Raises:
        ValueError: Unbiased, when the mask sums to 0 (TRL's sentence, then what to check here).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError(
                "The sum of the mask is zero, which can happen when `mini_batch_size=1`;try increase the "
                "`mini_batch_size` or `gradient_accumulation_steps`. Every response is empty: check "
                "`response_length` and `stop_token_id`."
            )
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise `values` to unit variance over the masked positions: `(x - mean) / sqrt(var + 1e-8)`.

    With `shift_mean=False` the mean is added back (only the scale changes), as done for rewards.

    Raises:
        ValueError: When fewer than 2 positions are unmasked (the variance is undefined; TRL's whitening would turn
            the rollout into NaN).
    """
    count = int(mask.sum())
    if count < 2:
        raise ValueError(
            f"Whitening needs at least 2 unmasked values, found {count}: check that the responses are not all empty "
            "(response_length, stop_token_id)."
        )
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


def per_token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probabilities.

    `k1`: `logp - ref_logp` (unbiased, can be negative); `k3`: `exp(r) - 1 - r` with `r = ref_logp - logp`
    (unbiased and non-negative, lower variance). See http://joschu.net/blog/kl-approx.html.
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}.")


class TokenRewards(NamedTuple):
    """Result of [`token_rewards`]: `(B, T)` tensors."""

    rewards: torch.Tensor
    kl: torch.Tensor
    non_score_reward: torch.Tensor


def token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    sequence_lengths: torch.Tensor,
    kl_coef: float,
    kl_estimator: str = "k1",
) -> TokenRewards:
    """Per-token rewards: `-kl_coef * KL` at every token, plus the sequence score on the token after the last one.

    The score lands at index `sequence_length + 1` (the position whose value is bootstrapped last, see
    [`response_masks`]) or at `sequence_length` when that is past the end of the response.

    Args:
        scores: `(B,)` reward-model scores.
        logprobs, ref_logprobs: `(B, T)` policy and reference log-probabilities (equal on padding positions).
        sequence_lengths: `(B,)` index of the last response token of each row.
        kl_coef: KL penalty coefficient.
        kl_estimator: `"k1"` or `"k3"` ([`per_token_kl`]).
    """
    kl = per_token_kl(logprobs, ref_logprobs, kl_estimator)
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rows = torch.arange(rewards.size(0), device=rewards.device)
    after_last = sequence_lengths + 1
    target = torch.where(after_last < rewards.size(1), after_last, sequence_lengths)
    rewards[rows, target] += scores
    return TokenRewards(rewards, kl, non_score_reward)


def response_masks(sequence_lengths: torch.Tensor, response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding masks of the responses: `(padding, padding_p1)`, True after the last token (`padding`) and after the
    position following it (`padding_p1`, used for values and rewards, which keep one bootstrap position)."""
    positions = torch.arange(response_length, device=sequence_lengths.device).unsqueeze(0)
    return positions > sequence_lengths.unsqueeze(1), positions > (sequence_lengths + 1).unsqueeze(1)


def generalized_advantage_estimation(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: `A_t = sum_k (gamma * lam)^k delta_{t+k}` with `delta_t = r_t + gamma * V_{t+1} - V_t` and `V_T = 0`.

    Computed for all positions at once (a triangular discount matrix) instead of a loop over tokens.

    Args:
        rewards: `(B, T)` per-token rewards.
        values: `(B, T)` value estimates.
        gamma: Discount factor.
        lam: GAE lambda.

    Returns:
        `(advantages, returns)`, both `(B, T)`; `returns = advantages + values`.
    """
    length = rewards.size(1)
    next_values = torch.cat([values[:, 1:], values.new_zeros(values.size(0), 1)], dim=1)
    deltas = rewards + gamma * next_values - values
    steps = torch.arange(length, device=rewards.device, dtype=rewards.dtype)
    offsets = steps.unsqueeze(1) - steps.unsqueeze(0)  # [k, t] = k - t
    decay = torch.tensor(gamma * lam, dtype=rewards.dtype, device=rewards.device)
    discount = torch.where(offsets >= 0, decay ** offsets.clamp(min=0), torch.zeros_like(offsets))
    advantages = deltas @ discount
    return advantages, advantages + values


class PolicyLoss(NamedTuple):
    """Result of [`clipped_policy_loss`]."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    ratio: torch.Tensor
    approxkl: torch.Tensor


def clipped_policy_loss(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
) -> PolicyLoss:
    """PPO's clipped surrogate: `mean(max(-A * rho, -A * clip(rho, 1 - eps, 1 + eps)))` over the masked tokens.

    `rho = exp(logp - old_logp)`. Also returns the fraction of tokens where the clipped term is the larger one
    (`clipfrac`), the ratios (`(B, T)`) and `approxkl = 0.5 * mean((logp - old_logp)^2)` over all positions.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), mask)
        approxkl = 0.5 * (log_ratio**2).mean()
    return PolicyLoss(loss, clipfrac, ratio, approxkl)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: `0.5 * mean(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))` over the masked
    positions, and the fraction of positions where the clipped error is the larger one."""
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    errors = (values - returns) ** 2
    clipped_errors = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(errors, clipped_errors), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_errors > errors).float(), mask)
    return loss, clipfrac

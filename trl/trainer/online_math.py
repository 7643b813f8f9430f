"""Pure tensor functions of the online RL trainers: rewards to advantages, KL estimate, completion masks.

No trainer state and nothing from the trainer modules: each function is tested against hand-written formulas
(`tests/test_grpo_trainer.py`, `tests/test_rloo_trainer.py`) and imported by the trainers that choose between them
(`_compute_advantages` and `_compute_loss` of [`GRPOTrainer`], [`RLOOTrainer`], ...).
"""

import torch


# Added to a standard deviation before dividing by it, so that groups with identical rewards give 0, not NaN.
ADVANTAGE_EPS = 1e-4


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is non-zero (0 when the mask is empty), over `dim` or everything."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counted from each row's first attended token (left padding at 0), as during generation."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


def aggregate_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the rewards of each completion, skipping NaN entries (a function that returned None).

    Args:
        rewards_per_func: `(N, F)` rewards, NaN where a function did not apply.
        weights: `(F,)` reward weights.

    Returns:
        `(N,)` aggregated rewards (0 for a completion no function applied to).
    """
    return (rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = ADVANTAGE_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages: each reward minus its group mean, optionally divided by a standard deviation.

    Consecutive blocks of `num_generations` rewards form a group (the completions of one prompt).

    Args:
        rewards: `(N,)` rewards, `N` a multiple of `num_generations`.
        num_generations: Group size G.
        scale_rewards: `"group"` divides by `std(group) + eps`, `"batch"` by `std(all rewards) + eps`, `"none"` keeps
            the centred rewards.
        eps: Added to the standard deviation.

    Returns:
        `(advantages, group_std)`, both `(N,)`; `group_std` is the (unbiased) std of each completion's group.
    """
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"The number of rewards ({rewards.numel()}) is not a multiple of the group size ({num_generations})."
        )
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    group_std = group_std_of(grouped).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards == "group":
        advantages = advantages / (group_std + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none'; got {scale_rewards!r}.")
    return advantages, group_std


def group_std_of(grouped: torch.Tensor) -> torch.Tensor:
    """Unbiased standard deviation of each row of `(groups, G)` rewards; 0 for groups of one completion (whose
    advantage is then 0, as in TRL, instead of NaN)."""
    if grouped.shape[1] < 2:
        return torch.zeros(grouped.shape[0], dtype=grouped.dtype, device=grouped.device)
    return grouped.std(dim=1)


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """RLOO advantages: each reward minus the mean reward of the other completions of its prompt.

    Args:
        rewards: `(N,)` rewards, consecutive groups of `num_generations`.
        num_generations: Group size G.

    Returns:
        `(N,)` advantages `r_i - (sum_j r_j - r_i) / (G - 1)` (0 when `G = 1`).
    """
    if num_generations < 1:
        raise ValueError(f"The leave-one-out baseline needs completions per prompt; got {num_generations}.")
    if num_generations == 1:  # no other completion to compare with (e.g. num_generations_eval=1): 0, as in TRL
        return torch.zeros_like(rewards)
    grouped = rewards.view(-1, num_generations)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    return (grouped - baseline).reshape(-1)


def k3_kl(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference) (Schulman): `exp(ref - logp) - (ref - logp) - 1 >= 0`."""
    delta = ref_per_token_logps - per_token_logps
    return torch.exp(delta) - delta - 1


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """Mask of the tokens up to and including the first end-of-sequence token of each row.

    Args:
        completion_ids: `(N, T)` generated ids (anything after the first EOS is padding).
        eos_token_ids: Ids that end a completion.

    Returns:
        `(mask, terminated)`: `(N, T)` int mask and `(N,)` bool, True where the row contains an EOS.
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    terminated = is_eos.any(dim=1)
    first_eos = torch.where(terminated, is_eos.int().argmax(dim=1), completion_ids.shape[1])
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(1)).int()
    return mask, terminated

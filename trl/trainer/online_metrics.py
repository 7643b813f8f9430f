"""Metrics and completion logs of the online RL trainers.

[`_OnlineMetricsMixin`] is inherited by `_OnlineTrainer` (see `online_base.py`): the rollout metrics of a round
(tokens, completion lengths, per-function rewards), reductions across processes, and the completions table
(printed with `rich`, written as parquet, sent to wandb) of `log_completions=True`.
"""

import json
import logging
import os
from typing import Any

import torch
from accelerate.utils import gather_object

from .online_math import group_std_of
from .online_math import masked_mean as _masked_mean
from .utils import nanstd, print_prompt_completions_sample


logger = logging.getLogger(__name__)


class _OnlineMetricsMixin:
    """Metrics and completion logging of [`_OnlineTrainer`] (not usable on its own).

    Reads from the trainer: `args`, `accelerator`, `state`, `reward_func_names`, `_metrics`, `_mode`,
    `_completion_logs`, `_logged_extra`, `_aggregated_rewards` and `_group_size`.
    """

    # Whether completions are scored by reward functions (False for distillation, whose signal is the teacher): when
    # False, no reward metrics are recorded and the completions table has no reward or advantage columns.
    _logs_rewards = True

    def _record_reduced(self, name: str, value: torch.Tensor, reduction: str) -> None:
        """Record local values (a scalar or a vector) reduced over all processes with `min`, `max` or `mean`
        (NaN-aware: NaN entries are ignored; NaN when none is left)."""
        local = value.detach().float().reshape(-1)
        if self.accelerator.num_processes > 1:  # vectors may differ in length between processes
            local = self.accelerator.pad_across_processes(local, dim=0, pad_index=float("nan"))
        gathered = self.accelerator.gather(local)
        finite = gathered[~torch.isnan(gathered)]
        if finite.numel() == 0:
            result = float("nan")
        elif reduction == "min":
            result = finite.min().item()
        elif reduction == "max":
            result = finite.max().item()
        else:
            result = finite.mean().item()
        self._metrics[self._mode][name].append(result)

    def _record_clip_metrics(self, low_clipped: torch.Tensor, high_clipped: torch.Tensor, mask: torch.Tensor) -> None:
        """`clip_ratio/*` as TRL defines them: the means are fractions of the micro-batch's completion tokens; the
        `low_min` / `high_max` extremes are over the per-completion fractions of all processes (a completion without
        loss tokens counts in neither; no completion at all gives None)."""
        low = low_clipped.expand_as(mask).float()
        high = high_clipped.expand_as(mask).float()
        self._record_metric("clip_ratio/low_mean", _masked_mean(low, mask))
        self._record_metric("clip_ratio/high_mean", _masked_mean(high, mask))
        self._record_metric("clip_ratio/region_mean", _masked_mean(torch.maximum(low, high), mask))
        counts = mask.sum(dim=1)
        undefined = torch.full_like(counts, float("nan"))
        per_low = torch.where(counts > 0, (low * mask).sum(dim=1) / counts.clamp(min=1.0), undefined)
        per_high = torch.where(counts > 0, (high * mask).sum(dim=1) / counts.clamp(min=1.0), undefined)
        self._record_reduced("clip_ratio/low_min", per_low, "min")
        self._record_reduced("clip_ratio/high_max", per_high, "max")

    def _record_rollout_metrics(
        self,
        mode: str,
        prompt_mask: torch.Tensor,
        completion_mask: torch.Tensor,
        terminated: torch.Tensor,
        lengths: torch.Tensor,
        rewards_per_func: torch.Tensor,
    ) -> None:
        gather = self.accelerator.gather
        metrics = self._metrics[mode]
        tokens = gather((prompt_mask.sum() + completion_mask.sum()).reshape(1)).sum().item()
        if mode == "train":
            self.state.num_input_tokens_seen += int(tokens)
            metrics["num_tokens"] = [float(self.state.num_input_tokens_seen)]
        else:  # as in TRL: evaluation logs the training tokens seen so far
            metrics["num_tokens"] = [float(self.state.num_input_tokens_seen)]

        all_lengths = gather(lengths.float())
        all_terminated = gather(terminated.long()).bool()
        metrics["completions/mean_length"].append(all_lengths.mean().item())
        metrics["completions/min_length"].append(all_lengths.min().item())
        metrics["completions/max_length"].append(all_lengths.max().item())
        terminated_lengths = all_lengths[all_terminated]
        if terminated_lengths.numel() == 0:
            terminated_lengths = torch.zeros(1, device=all_lengths.device)
        metrics["completions/mean_terminated_length"].append(terminated_lengths.mean().item())
        metrics["completions/min_terminated_length"].append(terminated_lengths.min().item())
        metrics["completions/max_terminated_length"].append(terminated_lengths.max().item())
        metrics["completions/clipped_ratio"].append(1.0 - all_terminated.float().mean().item())

        if not self._logs_rewards:
            return
        for i, name in enumerate(self.reward_func_names):
            column = rewards_per_func[:, i]
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(column).item())
            metrics[f"rewards/{name}/std"].append(nanstd(column).item())
        rewards = self._aggregated_rewards(rewards_per_func)
        group_std = group_std_of(self._rewards_for_zero_std(rewards).view(-1, self._group_size()))
        metrics["reward"].append(rewards.mean().item())
        # TRL's `reward_std` is the spread over the whole batch (not the mean of the per-group spreads).
        metrics["reward_std"].append(rewards.std().item())
        zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
        metrics["frac_reward_zero_std"].append(zero_std.float().mean().item())

    def _rewards_for_zero_std(self, rewards: torch.Tensor) -> torch.Tensor:
        """The `(N,)` rewards whose per-group spread `frac_reward_zero_std` counts (those the advantages are computed
        from; RLOO's include the KL penalty)."""
        return rewards

    def _store_completions(
        self,
        mode: str,
        prompts: list[Any],
        completions: list[Any],
        rewards_per_func: torch.Tensor,
        advantages: torch.Tensor,
    ) -> None:
        all_prompts = gather_object(prompts)
        all_completions = gather_object(completions)
        extra = {name: gather_object(values) for name, values in self._logged_extra.items()}
        self._logged_extra = {}
        rewards = rewards_per_func.cpu()
        rows = []
        for k, (prompt, completion) in enumerate(zip(all_prompts, all_completions)):
            row = {"step": self.state.global_step, "prompt": prompt, "completion": completion}
            if self._logs_rewards:
                for i, name in enumerate(self.reward_func_names):
                    row[name] = rewards[k, i].item()
            for name, values in extra.items():
                row[name] = values[k] if k < len(values) else None
            if self._logs_rewards:
                row["advantage"] = advantages[k].item()
            rows.append(row)
        limit = self.args.generation_batch_size
        self._completion_logs[mode] = (self._completion_logs[mode] + rows)[-limit:]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = self._mode
        super().log(logs, start_time)
        rows = self._completion_logs[mode]
        if not (getattr(self.args, "log_completions", False) and rows):
            return
        if not self.accelerator.is_main_process:
            return
        # As TRL: the latest rows (one generation batch at most) are logged at every logging step, stamped with it.
        log_completion_rows(
            self,
            rows,
            mode,
            unique_prompts=self.args.log_unique_prompts,
            reward_names=self.reward_func_names if self._logs_rewards else (),
            with_advantage=self._logs_rewards,
        )


def log_completion_rows(
    trainer: Any,
    rows: list[dict[str, Any]],
    mode: str,
    *,
    unique_prompts: bool,
    reward_names: Any = (),
    with_advantage: bool = False,
) -> None:
    """Log a completions table: printed with `rich`, written to `output_dir/completions/completions_<step>.parquet`
    (`_eval` suffix in evaluation) and sent to wandb when it is a `report_to` target.

    Args:
        trainer: The trainer (reads `args.num_completions_to_print`, `args.output_dir`, `args.report_to`, `state`).
        rows: One dict per completion with `prompt` and `completion`, the `reward_names` columns, `advantage` when
            `with_advantage`, and any extra columns (printed too). Stamped with the current global step.
        mode: `"train"` or `"eval"`.
        unique_prompts: Keep only the first row of each prompt.
        reward_names: Reward columns of the rows.
        with_advantage: Whether the rows have an `advantage` column.
    """
    step = trainer.state.global_step
    rows = [{**row, "step": step} for row in rows]
    if unique_prompts:
        seen, unique_rows = set(), []
        for row in rows:
            key = json.dumps(row["prompt"], sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                unique_rows.append(row)
        rows = unique_rows
    fixed = {"step", "prompt", "completion", "advantage", *reward_names}
    extra_names = [key for key in rows[0] if key not in fixed]
    try:
        print_prompt_completions_sample(
            [row["prompt"] for row in rows],
            [row["completion"] for row in rows],
            {name: [row[name] for row in rows] for name in reward_names},
            [row["advantage"] for row in rows] if with_advantage else None,
            step,
            trainer.args.num_completions_to_print,
            extra={name: [row.get(name) for row in rows] for name in extra_names} or None,
        )
    except ImportError:
        logger.warning("log_completions=True but `rich` is not installed; the completion table is not printed.")
    _write_completions_parquet(rows, trainer.args, step, mode)


def _write_completions_parquet(rows: list[dict[str, Any]], args: Any, step: int, mode: str) -> None:
    import pandas as pd

    def flatten(value: Any) -> Any:
        return value if isinstance(value, (str, int, float, bool)) or value is None else json.dumps(value, default=str)

    frame = pd.DataFrame([{key: flatten(value) for key, value in row.items()} for row in rows])
    folder = os.path.join(args.output_dir, "completions")
    os.makedirs(folder, exist_ok=True)
    suffix = "" if mode == "train" else "_eval"
    frame.to_parquet(os.path.join(folder, f"completions_{step:05d}{suffix}.parquet"))
    report_to = args.report_to or []
    if "wandb" in report_to:
        try:
            import wandb

            if wandb.run is not None:
                wandb.log({"completions": wandb.Table(dataframe=frame)})
        except ImportError:
            pass

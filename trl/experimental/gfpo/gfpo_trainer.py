"""GFPO: GRPO, except that each group is filtered down to `num_remains_in_group` completions before the advantages.

Sample more, train on fewer: a user function scores the `num_generations` completions of every group (e.g. by shortness
or reward per token), the top `num_remains_in_group` are kept, and the group-normalised advantages, the loss and the
rollout metrics use only them (Shrivastava et al., 2025, https://huggingface.co/papers/2508.09726).
"""

from collections.abc import Callable

import torch
from accelerate.utils import gather_object
from transformers.utils import logging

from ...trainer.grpo_trainer import GRPOTrainer
from ...trainer.online_math import aggregate_rewards
from .gfpo_config import GFPOConfig


logger = logging.get_logger(__name__)

GroupFilterFunc = Callable[..., list[list[float]]]


def top_rows_per_group(scores: torch.Tensor, num_kept: int) -> torch.Tensor:
    """Flat row indices of the `num_kept` highest-scoring completions of each group, in group order.

    Args:
        scores: `(num_groups, group_size)` scores.
        num_kept: Completions kept per group.

    Returns:
        `(num_groups * num_kept,)` indices into the flattened `(num_groups * group_size,)` rows; within a group the
        highest score comes first (ties keep the earlier completion).
    """
    group_size = scores.shape[1]
    _, within = torch.topk(scores, num_kept, dim=1)
    starts = torch.arange(scores.shape[0], device=scores.device).unsqueeze(1) * group_size
    return (starts + within).reshape(-1)


class GFPOTrainer(GRPOTrainer):
    """GRPO trained on the `num_remains_in_group` best completions of each group, as scored by `group_filter_func`.

    Example:

    ```python
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.gfpo import GFPOConfig, GFPOTrainer


    def shortest(group_completions, group_rewards, **kwargs):
        return [[-float(len(c)) for c in completions] for completions in group_completions]


    trainer = GFPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=lambda completions, **kw: [float(len(set(c))) for c in completions],
        args=GFPOConfig(output_dir="gfpo-out", num_generations=8, num_remains_in_group=4, max_steps=5),
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
        group_filter_func=shortest,
    )
    trainer.train()
    ```

    Args:
        model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes, callbacks,
        optimizers, peft_config: As [`GRPOTrainer`] (`args` is a [`experimental.gfpo.GFPOConfig`]).
        group_filter_func (`Callable` or `None`, defaults to `None`):
            Called in training as `group_filter_func(group_completions=..., group_rewards=...)` with one list per
            group: the group's `num_generations` completions and their (weighted-sum) rewards. Returns one score per
            completion, same nesting; the `args.num_remains_in_group` highest per group are kept. Required when
            `num_remains_in_group` is set; ignored (with a warning) otherwise. Evaluation uses every completion.
    """

    _tag_names = ["trl", "gfpo"]
    _name = "GFPO"
    _paper = {
        "title": "Sample More to Think Less: Group Filtered Policy Optimization for Concise Reasoning",
        "id": "2508.09726",
        "citation": (
            "@article{shrivastava2025sample,\n"
            "    title        = {{Sample More to Think Less: Group Filtered Policy Optimization for Concise Reasoning}},\n"
            "    author       = {Vaishnavi Shrivastava and Ahmed Awadallah and Vidhisha Balachandran and Shivam Garg "
            "and Harkirat Behl and Dimitris Papailiopoulos},\n"
            "    year         = 2025,\n"
            "    eprint       = {arXiv:2508.09726},\n"
            "}"
        ),
    }
    _config_class = GFPOConfig

    def __init__(
        self,
        model,
        reward_funcs,
        args: GFPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        group_filter_func: GroupFilterFunc | None = None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        num_kept = getattr(args, "num_remains_in_group", None)
        if num_kept is not None and group_filter_func is None:
            raise ValueError(
                f"Group filter function must not be None when num_remains_in_group ({num_kept}) is given. Pass "
                "group_filter_func=... (a function scoring each completion of each group) or unset "
                "num_remains_in_group."
            )
        if num_kept is None and group_filter_func is not None:
            logger.warning(
                "Group filter function is not activated since num_remains_in_group is not set: every completion is "
                "trained on. Set GFPOConfig(num_remains_in_group=...) to filter."
            )
        self.group_filter_func = group_filter_func
        self.num_remains_in_group = num_kept
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )

    def _filters(self) -> bool:
        return self.num_remains_in_group is not None and self._mode == "train"

    def _group_size(self) -> int:
        # After filtering, a group is the kept completions (advantages and zero-std metrics are taken over them).
        return self.num_remains_in_group if self._filters() else super()._group_size()

    def _select_rollout_rows(self, completions: list, rewards_per_func: torch.Tensor) -> torch.Tensor | None:
        if not self._filters():
            return None
        group = self.num_generations
        all_completions = gather_object(list(completions))
        rewards = aggregate_rewards(rewards_per_func, self.reward_weights.to(rewards_per_func.device))
        num_groups = len(all_completions) // group
        grouped_completions = [all_completions[i * group : (i + 1) * group] for i in range(num_groups)]
        scores = self.group_filter_func(
            group_completions=grouped_completions, group_rewards=rewards.view(num_groups, group).tolist()
        )
        scores = torch.as_tensor(scores, dtype=torch.float32, device=rewards.device)
        if scores.shape != (num_groups, group):
            raise ValueError(
                f"group_filter_func must return one score per completion of each group, a {num_groups} x {group} "
                f"nested list; got shape {tuple(scores.shape)}."
            )
        return top_rows_per_group(scores, self.num_remains_in_group)

"""Parity cases: plugin-shaped subclasses of GRPOTrainer (overriding TRL 1.16's protected hooks, as TRL's plugin
ecosystem does) run under real TRL and here; logs, call counts and the data each hook received must be equal.

The subclasses are written from the hook contract (`shared/api/extension_points.md`), not from any package.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

from . import register, run_trainer, to_jsonable
from .online import ONLINE_ARGS, RECORDED_COMPLETION_IDS, toy_reward


# Hooks whose calls every case counts (a plugin's override must run as often as under TRL).
COUNTED_HOOKS = (
    "_generate_and_score_completions",
    "_generate",
    "_tokenize_prompts",
    "_generate_single_turn",
    "_calculate_rewards",
    "_get_per_token_logps_and_entropies",
    "compute_loss",
    "_compute_loss",
)


def _counting(base, calls: Counter, extra: dict | None = None):
    """A subclass of `base` counting the calls of `COUNTED_HOOKS` (each deferring to the next class), plus `extra`."""

    def wrap(name):
        def method(self, *args, **kwargs):
            calls[name] += 1
            return getattr(super(counted, self), name)(*args, **kwargs)

        return method

    counted = type(f"Counting{base.__name__}", (base,), {name: wrap(name) for name in COUNTED_HOOKS})
    if not extra:
        return counted
    return type(f"Plugin{base.__name__}", (counted,), extra)


def plugin_case(ctx, plugin: str, max_steps: int = 2, **config) -> dict:
    import torch

    import trl

    calls: Counter = Counter()
    seen: list = []

    def calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super(cls, self)._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return rewards * self.reward_weights.to(rewards.device) + 1.0

    def generate_and_score(self, inputs):
        batch = super(cls, self)._generate_and_score_completions(inputs)
        if plugin == "batch_key":
            batch["row_hint"] = batch["completion_ids"][:, 0].clone().float()
        if plugin == "masked_rows":
            batch["num_items_in_batch"] = batch["num_items_in_batch"] - batch["completion_mask"][1::2].sum()
            batch["completion_mask"][1::2] = 0
            batch["advantages"] = torch.linspace(-1.0, 1.0, batch["advantages"].shape[0])
        seen.append(sorted(k for k, v in batch.items() if v is not None))
        return batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super(cls, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["plugin/hint"].append(float(inputs["row_hint"].sum()))
        return loss + 0.0 * inputs["row_hint"].sum()

    def single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        eos = self._tokenizer.eos_token_id
        completion_ids = [[7 + (i % num_generations), 11, eos] for i in range(len(prompt_ids))]
        return completion_ids, None

    extra = {
        "rewards": {"_calculate_rewards": calculate_rewards},
        "batch_key": {"_generate_and_score_completions": generate_and_score, "compute_loss": compute_loss},
        "masked_rows": {"_generate_and_score_completions": generate_and_score},
        "single_turn": {"_generate_single_turn": single_turn},
        "counts": {},
    }[plugin]
    cls = _counting(trl.GRPOTrainer, calls, extra)
    args = trl.GRPOConfig(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "max_steps": max_steps, **config})
    RECORDED_COMPLETION_IDS.clear()
    trainer = cls(
        model=ctx.model("tiny-Qwen2ForCausalLM"),
        reward_funcs=toy_reward,
        args=args,
        train_dataset=ctx.dataset("standard_prompt_only", "train", 16),
    )
    out = run_trainer(trainer, evaluate=False)
    out["calls"] = dict(sorted(calls.items()))
    out["batch_keys"] = seen
    out["completion_ids"] = list(RECORDED_COMPLETION_IDS)
    return to_jsonable(out)


SMALL = dict(per_device_train_batch_size=4, num_generations=4)
register("plugins/grpo/calculate_rewards", partial(plugin_case, plugin="rewards"))
register(
    "plugins/grpo/batch_key_to_compute_loss",
    partial(plugin_case, plugin="batch_key", steps_per_generation=2, **SMALL),
)
register("plugins/grpo/masked_rows_and_advantages", partial(plugin_case, plugin="masked_rows", max_steps=1))
register("plugins/grpo/generate_single_turn", partial(plugin_case, plugin="single_turn"))
register("plugins/grpo/call_counts", partial(plugin_case, plugin="counts"))
register(
    "plugins/grpo/call_counts/steps_per_generation=2",
    partial(plugin_case, plugin="counts", steps_per_generation=2, **SMALL),
)
register("plugins/grpo/call_counts/beta=0.04", partial(plugin_case, plugin="counts", beta=0.04))
register(
    "plugins/grpo/call_counts/num_iterations=2",
    partial(plugin_case, plugin="counts", num_iterations=2, gradient_accumulation_steps=2, **SMALL),
)


def rloo_rewards_plugin_case(ctx) -> dict:
    """An RLOO subclass shifting the rewards in `_calculate_rewards` and reading `old_logps` in `_compute_loss`."""
    import trl

    seen: list = []

    class ShiftedRewards(trl.RLOOTrainer):
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list) * 2.0 - 0.5

        def _compute_loss(self, model, inputs):
            seen.append(sorted(k for k, v in inputs.items() if v is not None))
            return super()._compute_loss(model, inputs)

    args = trl.RLOOConfig(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "max_steps": 2})
    RECORDED_COMPLETION_IDS.clear()
    trainer = ShiftedRewards(
        model=ctx.model("tiny-Qwen2ForCausalLM"),
        reward_funcs=toy_reward,
        args=args,
        train_dataset=ctx.dataset("standard_prompt_only", "train", 16),
    )
    out = run_trainer(trainer, evaluate=False)
    out["loss_batch_keys"] = seen
    out["completion_ids"] = list(RECORDED_COMPLETION_IDS)
    return to_jsonable(out)


def dpo_loss_plugin_case(ctx) -> dict:
    """A DPO subclass adding a term and a metric in `_compute_loss(model, inputs, return_outputs)`."""
    import trl

    class WithPenalty(trl.DPOTrainer):
        def _compute_loss(self, model, inputs, return_outputs):
            loss = super()._compute_loss(model, inputs, return_outputs)
            penalty = 0.01 * inputs["attention_mask"].float().mean()
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["plugin/penalty"].append(float(penalty))
            return loss + penalty

    from . import COMMON_ARGS

    args = trl.DPOConfig(output_dir=ctx.tmpdir(), **COMMON_ARGS)
    trainer = WithPenalty(
        model=ctx.model("tiny-Qwen2ForCausalLM"),
        args=args,
        train_dataset=ctx.dataset("standard_preference", "train", 8),
        eval_dataset=ctx.dataset("standard_preference", "test", 8),
    )
    return run_trainer(trainer)


register("plugins/rloo/calculate_rewards_and_loss_batch", rloo_rewards_plugin_case)
register("plugins/dpo/compute_loss_term", dpo_loss_plugin_case)

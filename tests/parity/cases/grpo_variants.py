"""Parity cases: the GRPO variants. GFPO against TRL 1.5 (`oracle="1.5"`, removed in 1.8); GRPO with replay buffer
and GSPO-token against TRL 1.12 (`oracle="1.12"`).

The training cases reuse the GRPO toy reward of `online.py` (one prompt of 8 completions a step, so GFPO's filter
sees a single group: TRL 1.5 hands the filter the completions of groups after the first shifted by one position).
"""

from __future__ import annotations

from functools import partial

from . import QWEN, expect_error, register, run_trainer, to_jsonable
from .online import ONLINE_ARGS, RECORDED_COMPLETION_IDS, toy_reward


FILTER_CALLS: list = []


def keep_highest_reward(group_completions, group_rewards, **kwargs):
    FILTER_CALLS.append([list(r) for r in group_rewards])
    return [list(r) for r in group_rewards]


def keep_shortest(group_completions, group_rewards, **kwargs):
    FILTER_CALLS.append([[len(c) for c in g] for g in group_completions])
    return [[-float(len(c)) for c in g] for g in group_completions]


def _trainer_classes(kind: str):
    import importlib

    if kind == "gfpo":
        mod = importlib.import_module("trl.experimental.gfpo")
        return mod.GFPOConfig, mod.GFPOTrainer
    if kind == "replay":
        mod = importlib.import_module("trl.experimental.grpo_with_replay_buffer")
        return mod.GRPOWithReplayBufferConfig, mod.GRPOWithReplayBufferTrainer
    import trl

    mod = importlib.import_module("trl.experimental.gspo_token")
    return trl.GRPOConfig, mod.GRPOTrainer


def variant_case(ctx, kind: str, *, max_steps: int = 2, group_filter_func=None, **config) -> dict:
    """`max_steps` logged GRPO-variant steps on the toy reward."""
    config_cls, trainer_cls = _trainer_classes(kind)
    args = config_cls(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "max_steps": max_steps, **config})
    RECORDED_COMPLETION_IDS.clear()
    FILTER_CALLS.clear()
    extra = {"group_filter_func": group_filter_func} if kind == "gfpo" else {}
    trainer = trainer_cls(
        model=ctx.model(QWEN),
        reward_funcs=toy_reward,
        args=args,
        train_dataset=ctx.dataset("standard_prompt_only", "train", 16),
        **extra,
    )
    out = run_trainer(trainer, evaluate=False)
    out["completion_ids"] = list(RECORDED_COMPLETION_IDS)
    out["filter_calls"] = list(FILTER_CALLS)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# GFPO (TRL 1.5)
# ---------------------------------------------------------------------------------------------------------------------
_GFPO = dict(oracle="1.5")
register(
    "gfpo/keep_highest_reward",
    partial(variant_case, kind="gfpo", num_remains_in_group=4, group_filter_func=keep_highest_reward),
    **_GFPO,
)
register(
    "gfpo/keep_shortest",
    partial(variant_case, kind="gfpo", num_remains_in_group=3, group_filter_func=keep_shortest),
    **_GFPO,
)
register("gfpo/no_filter", partial(variant_case, kind="gfpo", max_steps=1), **_GFPO)


def gfpo_error_case(ctx, with_func: bool, **config) -> dict:
    def build():
        config_cls, trainer_cls = _trainer_classes("gfpo")
        args = config_cls(output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, **config})
        return trainer_cls(
            model=ctx.model(QWEN),
            reward_funcs=toy_reward,
            args=args,
            train_dataset=ctx.dataset("standard_prompt_only", "train", 8),
            group_filter_func=keep_shortest if with_func else None,
        )

    return expect_error(build)


register(
    "gfpo/error/num_remains_in_group=num_generations",
    partial(gfpo_error_case, with_func=True, num_remains_in_group=8),
    phrases=("must be less than num_generations",),
    **_GFPO,
)
register(
    "gfpo/error/no_group_filter_func",
    partial(gfpo_error_case, with_func=False, num_remains_in_group=4),
    phrases=("Group filter function must not be None",),
    **_GFPO,
)

# ---------------------------------------------------------------------------------------------------------------------
# GRPO with replay buffer (TRL 1.12)
# ---------------------------------------------------------------------------------------------------------------------
_REPLAY = dict(oracle="1.12")
# One group a step whose toy rewards vary: stored, never replaced, so training is GRPO's.
register(
    "grpo_with_replay_buffer/varying_rewards", partial(variant_case, kind="replay", replay_buffer_size=4), **_REPLAY
)


def replay_buffer_case(ctx) -> dict:
    """`ReplayBuffer`: insertion order, eviction of the lowest score, rejection of lower scores, seeded sampling."""
    import torch

    from trl.experimental.grpo_with_replay_buffer import ReplayBuffer

    buffer = ReplayBuffer(max_size=3)
    out = {"empty_sample": buffer.sample(2)}
    buffer.add([0.5, 0.1, 0.9, 0.3], [{"id": i} for i in range(4)])
    out["heap_after_add"] = [[score, item["id"]] for score, item in buffer.heap]
    buffer.add([0.2, 0.95], [{"id": 4}, {"id": 5}])
    out["heap_after_evict"] = [[score, item["id"]] for score, item in buffer.heap]
    torch.manual_seed(0)
    out["sample_2"] = [item["id"] for item in buffer.sample(2)]
    out["sample_5"] = [item["id"] for item in buffer.sample(5)]
    return out


register("grpo_with_replay_buffer/buffer", replay_buffer_case, **_REPLAY)


def replay_update_case(ctx, advantages: list, stds: list) -> dict:
    """`update_with_replay_buffer` on a prepopulated buffer: the returned batch (or None) and the stored scores."""
    import torch
    from datasets import Dataset

    from trl.experimental.grpo_with_replay_buffer import (
        GRPOWithReplayBufferConfig,
        GRPOWithReplayBufferTrainer,
        ReplayBuffer,
    )

    args = GRPOWithReplayBufferConfig(output_dir=ctx.tmpdir(), replay_buffer_size=5, report_to="none", use_cpu=True)
    trainer = GRPOWithReplayBufferTrainer(
        model=ctx.model(QWEN),
        reward_funcs=toy_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
    )
    trainer.replay_buffer = ReplayBuffer(max_size=5)
    trainer.num_generations = 2
    stored = []
    for s in range(2):
        stored.append(
            {
                "prompt_ids": torch.tensor([[100 + s, 101], [102, 103]]),
                "prompt_mask": torch.ones(2, 2, dtype=torch.long),
                "completion_ids": torch.tensor([[5, 6], [7, 8]]),
                "completion_mask": torch.ones(2, 2, dtype=torch.long),
                "advantages": torch.tensor([[0.5, 0.6 + s]]),
                "old_per_token_logps": torch.full((2, 2), -1.0 - s),
            }
        )
    trainer.replay_buffer.add([0.1, 0.9], stored)
    group_advantages = torch.tensor(advantages)
    torch.manual_seed(0)
    result = trainer.update_with_replay_buffer(
        group_advantages=group_advantages,
        group_std_rewards=torch.tensor(stds),
        prompt_ids=torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]]),
        prompt_mask=torch.ones(4, 2, dtype=torch.long),
        completion_ids=torch.tensor([[9, 10], [11, 12], [13, 14], [15, 16]]),
        completion_mask=torch.ones(4, 2, dtype=torch.long),
        forward_kwargs={},
        num_items_in_batch=4,
        old_per_token_logps=torch.zeros(4, 2),
    )
    return {
        "result": None if result is None else to_jsonable(dict(sorted(result.items()))),
        "heap_scores": sorted(round(score, 6) for score, _ in trainer.replay_buffer.heap),
    }


register(
    "grpo_with_replay_buffer/update/no_variance",
    partial(replay_update_case, advantages=[[0.5, 0.5], [0.8, 0.8]], stds=[[0.0, 0.0], [0.0, 0.0]]),
    **_REPLAY,
)
register(
    "grpo_with_replay_buffer/update/all_vary",
    partial(replay_update_case, advantages=[[0.1, 0.9], [-0.3, 0.7]], stds=[[0.5, 0.5], [0.7, 0.7]]),
    **_REPLAY,
)

# ---------------------------------------------------------------------------------------------------------------------
# GSPO-token (TRL 1.12)
# ---------------------------------------------------------------------------------------------------------------------
_GSPO = dict(oracle="1.12")
register(
    "gspo_token/sequence_token",
    partial(variant_case, kind="gspo_token", importance_sampling_level="sequence_token", num_iterations=2),
    **_GSPO,
)
register(
    "gspo_token/sequence_token/loss_type=grpo",
    partial(
        variant_case, kind="gspo_token", importance_sampling_level="sequence_token", loss_type="grpo", num_iterations=2
    ),
    **_GSPO,
)
register(
    "gspo_token/sequence_token/beta=0.04",
    partial(variant_case, kind="gspo_token", importance_sampling_level="sequence_token", num_iterations=2, beta=0.04),
    **_GSPO,
)
register(
    "gspo_token/token",
    partial(variant_case, kind="gspo_token", max_steps=1, importance_sampling_level="token"),
    **_GSPO,
)


def stable_grpo_sequence_token_case(ctx) -> dict:
    """The stable GRPOTrainer with GSPO-token's level: TRL raises when the loss runs, this project at construction."""

    def build_and_train():
        import trl

        args = trl.GRPOConfig(
            output_dir=ctx.tmpdir(), **{**ONLINE_ARGS, "max_steps": 1, "importance_sampling_level": "sequence_token"}
        )
        trainer = trl.GRPOTrainer(
            model=ctx.model(QWEN),
            reward_funcs=toy_reward,
            args=args,
            train_dataset=ctx.dataset("standard_prompt_only", "train", 8),
        )
        trainer.train()

    return expect_error(build_and_train)


register(
    "gspo_token/error/stable_trainer",
    stable_grpo_sequence_token_case,
    phrases=("Unknown importance sampling level: sequence_token",),
)

"""GFPOTrainer: top-k selection, the group filter (exactly `num_remains_in_group` kept, chosen by the filter, advantages
over the kept group), training, save/resume and bad input."""

import logging
import math

import pytest
import torch
from trainer_utils import (
    GROUP_ARGS,
    args_builder,
    assert_saved_model_reloads,
    resume_from_first_checkpoint,
    train_and_check_metrics,
)

from trl.experimental.gfpo import GFPOConfig, GFPOTrainer, top_rows_per_group


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(GFPOConfig, **{**GROUP_ARGS, "num_generations": 4, "num_remains_in_group": 2})

GFPO_METRICS = ["reward", "reward_std", "frac_reward_zero_std", "entropy", "completions/mean_length"]


def distinct_ids_reward(completion_ids, **kwargs):
    return [float(len(set(ids))) + 0.1 * ids[0] / 1000 if ids else 0.0 for ids in completion_ids]


def shortest_first(group_completions, group_rewards, **kwargs):
    return [[-float(len(c)) for c in completions] for completions in group_completions]


def test_top_rows_per_group_matches_loop():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.3], [2.0, -1.0, 3.0, 0.0]])
    expected = []
    for g, row in enumerate(scores.tolist()):
        order = sorted(range(4), key=lambda i: -row[i])[:2]
        expected += [g * 4 + i for i in order]
    assert top_rows_per_group(scores, 2).tolist() == expected == [1, 2, 6, 4]


def test_filter_keeps_num_remains_per_group_and_normalises_over_them(tmp_path, model_path, prompts):
    seen = {}

    def by_reward(group_completions, group_rewards, **kwargs):
        seen["groups"] = [list(g) for g in group_completions]
        seen["rewards"] = [list(r) for r in group_rewards]
        return [list(r) for r in group_rewards]

    args = make_args(tmp_path, per_device_train_batch_size=8, max_steps=1, num_generations=4, num_remains_in_group=3)
    trainer = GFPOTrainer(
        model=model_path,
        reward_funcs=distinct_ids_reward,
        args=args,
        train_dataset=prompts,
        group_filter_func=by_reward,
    )
    trainer.model.train()
    rows = [prompts[0], prompts[0], prompts[0], prompts[0], prompts[1], prompts[1], prompts[1], prompts[1]]
    batch = trainer._generate_and_score_completions(rows)
    assert len(seen["groups"]) == 2 and all(len(g) == 4 for g in seen["groups"])
    assert batch["completion_ids"].shape[0] == 6  # 2 groups x num_remains_in_group
    kept_rewards = []
    for rewards in seen["rewards"]:
        kept_rewards += sorted(rewards, reverse=True)[:3]  # the filter scores by reward: the best three stay
    expected = []
    for g in range(2):
        group = kept_rewards[3 * g : 3 * g + 3]
        mean = sum(group) / 3
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 2)
        expected += [(r - mean) / (std + 1e-4) for r in group]
    torch.testing.assert_close(batch["advantages"], torch.tensor(expected), rtol=1e-4, atol=1e-4)


def test_filter_choice_follows_the_function(tmp_path, model_path, prompts):
    args = make_args(tmp_path, per_device_train_batch_size=4, max_steps=1, num_generations=4, num_remains_in_group=2)
    trainer = GFPOTrainer(
        model=model_path,
        reward_funcs=distinct_ids_reward,
        args=args,
        train_dataset=prompts,
        group_filter_func=shortest_first,
    )
    trainer.model.train()
    texts = ["a", "bbbb", "cc", "ddddddd"]
    keep = trainer._select_rollout_rows(texts, torch.zeros(4, 1))
    assert keep.tolist() == [0, 2]  # the two shortest completions
    trainer.model.eval()
    assert trainer._select_rollout_rows(texts, torch.zeros(4, 1)) is None  # evaluation keeps every completion


def test_trains_logs_and_evaluates(tmp_path, model_path, prompts):
    args = make_args(tmp_path, per_device_eval_batch_size=4)
    trainer = GFPOTrainer(
        model=model_path,
        reward_funcs=distinct_ids_reward,
        args=args,
        train_dataset=prompts,
        eval_dataset=prompts.select(range(2)),
        group_filter_func=shortest_first,
    )
    train_and_check_metrics(trainer, GFPO_METRICS)
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(
        GFPOTrainer,
        args,
        tmp_path,
        model=model_path,
        reward_funcs=distinct_ids_reward,
        train_dataset=prompts,
        group_filter_func=shortest_first,
    )


def test_bad_options(tmp_path, model_path, prompts, caplog):
    with pytest.raises(ValueError, match="must be less than num_generations"):
        make_args(tmp_path, num_generations=4, num_remains_in_group=4)
    with pytest.raises(ValueError, match="at least 2"):
        make_args(tmp_path, num_generations=4, num_remains_in_group=1)
    with pytest.raises(ValueError, match="Group filter function must not be None"):
        GFPOTrainer(
            model=model_path, reward_funcs=distinct_ids_reward, args=make_args(tmp_path), train_dataset=prompts
        )
    with caplog.at_level(logging.WARNING):
        trainer = GFPOTrainer(
            model=model_path,
            reward_funcs=distinct_ids_reward,
            args=make_args(tmp_path, num_remains_in_group=None),
            train_dataset=prompts,
            group_filter_func=shortest_first,
        )
    assert "not activated" in caplog.text
    trainer.model.train()
    assert trainer._select_rollout_rows(["a"] * 4, torch.zeros(4, 1)) is None


def test_filter_returning_wrong_shape_is_explained(tmp_path, model_path, prompts):
    trainer = GFPOTrainer(
        model=model_path,
        reward_funcs=distinct_ids_reward,
        args=make_args(tmp_path),
        train_dataset=prompts,
        group_filter_func=lambda group_completions, group_rewards: [[1.0, 2.0]],
    )
    trainer.model.train()
    with pytest.raises(ValueError, match="one score per completion"):
        trainer._select_rollout_rows(["a"] * 4, torch.zeros(4, 1))

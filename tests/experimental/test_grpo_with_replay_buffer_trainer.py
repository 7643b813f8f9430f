"""GRPOWithReplayBufferTrainer: the buffer's insertion/eviction order and sampling, zero-variance groups replaced with
stored ones re-padded like fresh groups, a training run where some prompts always get the same reward, save/resume."""

import pytest
import torch
from trainer_utils import (
    GROUP_ARGS,
    args_builder,
    assert_saved_model_reloads,
    resume_from_first_checkpoint,
    train_and_check_metrics,
)

from trl.experimental.grpo_with_replay_buffer import (
    GRPOWithReplayBufferConfig,
    GRPOWithReplayBufferTrainer,
    ReplayBuffer,
)


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(GRPOWithReplayBufferConfig, **{**GROUP_ARGS, "replay_buffer_size": 4})
PAD = 0


# ---------------------------------------------------------------------------------------------------------------------
# ReplayBuffer
# ---------------------------------------------------------------------------------------------------------------------
def test_buffer_keeps_the_highest_scores_and_evicts_the_lowest():
    buffer = ReplayBuffer(max_size=3)
    buffer.add([0.5, 0.8, 0.3], [{"id": 1}, {"id": 2}, {"id": 3}])
    assert buffer.heap[0] == (0.3, {"id": 3})  # min-heap: the lowest score first
    buffer.add([0.9], [{"id": 4}])  # evicts 0.3
    buffer.add([0.1], [{"id": 5}])  # lower than every stored score: not added
    assert sorted(score for score, _ in buffer.heap) == [0.5, 0.8, 0.9]
    assert buffer.heap[0][0] == 0.5
    buffer.add([0.7, 0.7], [{"id": 6}, {"id": 7}])  # equal scores never compare the data
    assert sorted(score for score, _ in buffer.heap) == [0.7, 0.8, 0.9]
    with pytest.raises(ValueError, match="one score per item"):
        buffer.add([1.0], [])


def test_buffer_samples_in_proportion_to_scores():
    buffer = ReplayBuffer(max_size=2)
    assert buffer.sample(1) is None
    buffer.add([1.0, 3.0], [{"id": "low"}, {"id": "high"}])
    torch.manual_seed(0)
    draws = [item["id"] for _ in range(400) for item in buffer.sample(1)]
    assert 0.65 < draws.count("high") / len(draws) < 0.85
    assert len(buffer.sample(5)) == 5  # more than stored: with replacement
    assert sorted(item["id"] for item in buffer.sample(2)) == ["high", "low"]  # otherwise without


# ---------------------------------------------------------------------------------------------------------------------
# Group replacement
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def trainer(tmp_path, model_path, prompts):
    trainer = GRPOWithReplayBufferTrainer(
        model=model_path,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=make_args(tmp_path),
        train_dataset=prompts,
    )
    trainer.pad_token_id = PAD
    return trainer


def _batch(advantages, prompt_width=3, completion_width=4, offset=0):
    rows = advantages.numel()
    prompt_ids = torch.arange(rows * prompt_width).view(rows, prompt_width) + 10 + offset
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[:, 0] = 0  # a left-padding column shared by the whole batch
    prompt_ids[:, 0] = PAD
    completion_ids = torch.arange(rows * completion_width).view(rows, completion_width) + 100 + offset
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[:, -1] = 0  # a right-padding column
    completion_ids[:, -1] = PAD
    return dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        old_per_token_logps=-torch.rand(rows, completion_width) * completion_mask,
    )


def test_varying_groups_are_stored_trimmed_and_scored(trainer):
    advantages = torch.tensor([[1.0, -1.0], [0.0, 0.0]])
    stds = torch.tensor([0.5, 0.0])
    out = trainer.update_with_replay_buffer(
        advantages, stds, **_batch(advantages), forward_kwargs={}, num_items_in_batch=8
    )
    # The varying group is stored first, so it is also what replaces the zero-variance group.
    assert len(trainer.replay_buffer) == 1
    assert out["advantages"].tolist() == [[1.0, -1.0], [1.0, -1.0]]
    assert torch.equal(out["completion_ids"][2:], out["completion_ids"][:2])
    score, stored = trainer.replay_buffer.heap[0]
    assert score == pytest.approx(0.5 * 2.0)  # std x sum |advantages|
    assert stored["prompt_ids"].shape == (2, 2) and stored["completion_ids"].shape == (2, 3)  # padding dropped
    assert stored["old_per_token_logps"].shape == (2, 3)
    assert stored["advantages"].tolist() == [1.0, -1.0]


def test_zero_variance_groups_are_replaced_with_fresh_shapes_and_padding(trainer):
    stored_adv = torch.tensor([[2.0, -2.0]])
    stored = _batch(stored_adv, prompt_width=5, completion_width=2, offset=1000)  # longer prompts, shorter completions
    trainer.update_with_replay_buffer(
        stored_adv, torch.tensor([1.0]), **stored, forward_kwargs={}, num_items_in_batch=2
    )
    advantages = torch.tensor([[0.0, 0.0], [0.5, -0.5], [0.0, 0.0]])
    fresh = _batch(advantages)
    out = trainer.update_with_replay_buffer(
        advantages, torch.tensor([0.0, 0.3, 0.0]), **fresh, forward_kwargs={}, num_items_in_batch=6
    )
    assert out["num_items_in_batch"] == 6
    # Widths: the widest real prompt (4 tokens, replayed) and completion (3 tokens, fresh); no all-padding column.
    assert out["prompt_ids"].shape == (6, 4) and out["completion_ids"].shape == (6, 3)
    assert out["prompt_mask"].bool().any(dim=0).all() and out["completion_mask"].bool().any(dim=0).all()
    # Groups 0 and 2 are a stored group (the only one with variance is the stored or the fresh one).
    for group in (0, 2):
        rows = slice(2 * group, 2 * group + 2)
        assert out["advantages"][group].abs().sum() > 0
        ids = out["prompt_ids"][rows][out["prompt_mask"][rows].bool()]
        assert ids.min() >= 10  # real tokens only under the mask
    # The kept group is unchanged apart from padding: same real tokens, prompts left-padded, completions right-padded.
    kept = slice(2, 4)
    assert torch.equal(out["prompt_ids"][kept][:, -2:], fresh["prompt_ids"][kept][:, 1:])
    assert out["prompt_mask"][kept][:, :2].sum() == 0  # left padding
    assert torch.equal(out["completion_ids"][kept], fresh["completion_ids"][kept][:, :3])
    assert torch.equal(out["advantages"][1], advantages[1])
    # Replayed completions of 2 tokens are right-padded to 3, their log-probs padded with zeros.
    replayed_rows = [r for g in (0, 2) for r in (2 * g, 2 * g + 1) if out["completion_ids"][r, 0] >= 1000]
    for r in replayed_rows:
        assert out["completion_mask"][r].tolist() == [1, 0, 0]
        assert out["completion_ids"][r, 1:].tolist() == [PAD, PAD]
        assert out["old_per_token_logps"][r, 1:].tolist() == [0.0, 0.0]


def test_trl_test_layout_of_stds_is_read_per_group(trainer):
    # TRL's tests broadcast the per-group std vector along rows: group g is column g.
    advantages = torch.tensor([[0.6, 0.6], [0.3, 0.45]])
    layout = advantages.std(dim=1).expand_as(advantages)
    trainer.replay_buffer.add([0.9], [_group_like(2)])
    out = trainer.update_with_replay_buffer(
        advantages, layout, **_batch(advantages), forward_kwargs={}, num_items_in_batch=4
    )
    assert out is not None and len(trainer.replay_buffer) == 2  # group 1 stored, group 0 replaced


def _group_like(group):
    data = _batch(torch.zeros(group), offset=500)
    data["advantages"] = torch.tensor([[0.5, -0.5]])
    return data


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------
def half_constant_reward(prompts, completion_ids, **kwargs):
    """Constant for every other prompt (no learning signal there), varying with the completion otherwise."""
    return [1.0 if len(p) % 2 else float(sum(ids) % 7) for p, ids in zip(prompts, completion_ids)]


def test_training_with_constant_reward_prompts_replays_groups(tmp_path, model_path, prompts):
    args = make_args(
        tmp_path, per_device_train_batch_size=8, num_generations=2, max_steps=3, per_device_eval_batch_size=4
    )
    trainer = GRPOWithReplayBufferTrainer(
        model=model_path,
        reward_funcs=half_constant_reward,
        args=args,
        train_dataset=prompts,
        eval_dataset=prompts.select(range(2)),
    )
    calls = []
    original = trainer._replay

    def spy(tensors, stds):
        out = original(tensors, stds)
        calls.append((int((stds == 0).sum()), out))
        return out

    trainer._replay = spy
    train_and_check_metrics(trainer, ["reward", "frac_reward_zero_std", "entropy"])
    assert len(trainer.replay_buffer) > 0
    replaced = [out for zero, out in calls if zero and out is not None]
    assert replaced, "a batch with zero-variance groups should have replayed stored groups"
    for out in replaced:
        assert out["advantages"].view(-1, 2).abs().sum(dim=1).gt(0).all()  # every group now has a signal
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(
        GRPOWithReplayBufferTrainer,
        args,
        tmp_path,
        model=model_path,
        reward_funcs=half_constant_reward,
        train_dataset=prompts,
    )


def test_bad_options(tmp_path):
    with pytest.raises(ValueError, match="replay_buffer_size must be >= 0"):
        make_args(tmp_path, replay_buffer_size=-1)

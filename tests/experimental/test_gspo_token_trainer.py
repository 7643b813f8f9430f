"""GSPO-token (`trl.experimental.gspo_token.GRPOTrainer`): the ratio equals GSPO's in value, its gradient follows the
hand formula, and the trainer trains, evaluates, saves and resumes with `importance_sampling_level="sequence_token"`."""

import math

import pytest
import torch
from trainer_utils import (
    GROUP_ARGS,
    args_builder,
    assert_saved_model_reloads,
    resume_from_first_checkpoint,
    token_sum_reward,
    train_and_check_metrics,
)

from trl import GRPOConfig
from trl import GRPOTrainer as StableGRPOTrainer
from trl.experimental.gspo_token import GRPOTrainer
from trl.experimental.gspo_token.grpo_trainer import sequence_token_log_weights
from trl.trainer.grpo_trainer import grpo_per_token_loss, importance_log_weights, normalize_per_token_loss


def _log_weights(logps, old, mask, level):
    if level == "sequence_token":
        return sequence_token_log_weights(logps, old, mask)
    return importance_log_weights(logps, old, mask, level)


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(
    GRPOConfig, **{**GROUP_ARGS, "importance_sampling_level": "sequence_token", "loss_type": "grpo", "beta": 0.04}
)

LOGPS = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.5], [-0.7, -0.9, -1.1]]
OLD = [[-1.1, -1.8, -0.5], [-0.2, -1.25, -2.4], [-0.7, -0.6, -1.6]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
ADV = [1.5, -0.7, 0.4]


def _loss_and_grad(level, advantages=ADV, eps=(0.2, 0.28)):
    logps = torch.tensor(LOGPS, requires_grad=True)
    per_token, ratio, _ = grpo_per_token_loss(
        logps,
        torch.tensor(OLD),
        torch.tensor(advantages),
        torch.tensor(MASK),
        loss_type="grpo",
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        log_weights=_log_weights(logps, torch.tensor(OLD), torch.tensor(MASK), level),
    )
    loss = normalize_per_token_loss(per_token, torch.tensor(MASK), "grpo")
    loss.backward()
    return loss.detach(), ratio.detach(), logps.grad


def _sequence_log_ratios():
    return [sum((a - b) * m for a, b, m in zip(lp, old, mask)) / sum(mask) for lp, old, mask in zip(LOGPS, OLD, MASK)]


def test_ratio_value_equals_sequence_ratio_at_every_token():
    log_w = sequence_token_log_weights(torch.tensor(LOGPS), torch.tensor(OLD), torch.tensor(MASK))
    expected = [[s] * 3 for s in _sequence_log_ratios()]
    torch.testing.assert_close(log_w, torch.tensor(expected))


def test_loss_value_equals_gspo_and_gradient_matches_hand_formula():
    token_loss, token_ratio, token_grad = _loss_and_grad("sequence_token")
    seq_loss, seq_ratio, seq_grad = _loss_and_grad("sequence")
    torch.testing.assert_close(token_loss, seq_loss)
    torch.testing.assert_close(token_ratio, seq_ratio.expand_as(token_ratio))
    # Hand gradient of GSPO-token (grpo normalisation: mean over sequences of the token mean): each unclipped token
    # gets -A_i * exp(s_i) / (|o_i| * B); a clipped sequence (ratio outside [1 - eps_low, 1 + eps_high] on the side
    # its advantage pushes) gets none.
    expected = []
    for s, adv, mask in zip(_sequence_log_ratios(), ADV, MASK):
        ratio = math.exp(s)
        clipped = (adv > 0 and ratio > 1.28) or (adv < 0 and ratio < 0.8)
        length = sum(mask)
        expected.append([0.0 if clipped else -adv * ratio * m / (length * len(ADV)) for m in mask])
    torch.testing.assert_close(token_grad, torch.tensor(expected))
    # With one advantage per sequence, GSPO's gradient (through the sequence mean) is the same.
    torch.testing.assert_close(seq_grad, token_grad)


def test_per_token_advantages_change_the_gradient_as_the_formula_says():
    # GSPO-token's point: with advantages that vary along the sequence, token t is pushed by its own A_{i,t} while
    # GSPO pushes every token of the sequence by the mean advantage.
    logps = torch.tensor(LOGPS, requires_grad=True)
    mask = torch.tensor(MASK)
    adv = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.0, -1.0], [2.0, 1.0, -0.5]])
    results = {}
    for level in ("sequence_token", "sequence"):
        logps.grad = None
        log_w = _log_weights(logps, torch.tensor(OLD), mask, level)
        loss = (-(torch.exp(log_w) * adv) * mask).sum(dim=1).div(mask.sum(dim=1)).mean()
        loss.backward()
        results[level] = logps.grad.clone()
    for i, (s, m_row) in enumerate(zip(_sequence_log_ratios(), MASK)):
        length, ratio = sum(m_row), math.exp(s)
        mean_adv = sum(a * m for a, m in zip(adv[i].tolist(), m_row)) / length
        for t, m in enumerate(m_row):
            token_expected = -adv[i, t].item() * ratio * m / (length * 3)
            seq_expected = -mean_adv * ratio * m / (length * 3)
            assert results["sequence_token"][i, t].item() == pytest.approx(token_expected, abs=1e-6)
            assert results["sequence"][i, t].item() == pytest.approx(seq_expected, abs=1e-6)


def test_trains_logs_evaluates_and_saves(tmp_path, model_path, prompts):
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=token_sum_reward,
        args=make_args(tmp_path, per_device_eval_batch_size=4, steps_per_generation=2, num_iterations=2),
        train_dataset=prompts,
        eval_dataset=prompts.select(range(2)),
    )
    train_and_check_metrics(trainer, ["kl", "entropy", "clip_ratio/region_mean"])
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(
        GRPOTrainer, args, tmp_path, model=model_path, reward_funcs=token_sum_reward, train_dataset=prompts
    )


def test_stable_trainer_rejects_sequence_token_before_training(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="Possible values are 'token' and 'sequence'"):
        StableGRPOTrainer(
            model=model_path, reward_funcs=token_sum_reward, args=make_args(tmp_path), train_dataset=prompts
        )

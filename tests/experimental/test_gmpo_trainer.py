"""GMPOTrainer: the geometric-mean objective against a hand-written loop, training with TRL's metric keys,
save/reload/resume, the default config and bad input."""

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

from trl.experimental.gmpo import GMPOConfig, GMPOTrainer, gmpo_sequence_ratio


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(GMPOConfig, **GROUP_ARGS)

GMPO_METRICS = [
    "reward",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
]

LOGPS = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.5], [-0.7, -0.9, -1.1], [-0.2, -0.1, -3.0]]
OLD = [[-1.6, -1.8, -0.5], [-0.2, -1.5, -2.0], [-0.7, -0.6, -1.6], [-0.2, -0.5, -3.0]]
ADV = [1.5, -0.7, 0.0, 0.4]
MASK = [[1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]]


def reward_len(completion_ids, **kwargs):
    return [float(len(set(ids))) + 0.01 * ids[0] if ids else 0.0 for ids in completion_ids]


def _hand_rho(eps_low, eps_high):
    out = []
    for lp, old, adv, mask in zip(LOGPS, OLD, ADV, MASK):
        total = 0.0
        for a, b, m in zip(lp, old, mask):
            r = a - b
            c = min(max(r, -eps_low), eps_high)
            total += m * (min(r, c) if adv > 0 else max(r, c))
        out.append(math.exp(total / max(sum(mask), 1)))
    return out


@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.1, 0.3)])
def test_sequence_ratio_matches_hand_formula(eps):
    logps = torch.tensor(LOGPS, dtype=torch.float64, requires_grad=True)
    rho, stats = gmpo_sequence_ratio(
        logps, torch.tensor(OLD, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK), *eps
    )
    torch.testing.assert_close(rho, torch.tensor(_hand_rho(*eps), dtype=torch.float64))
    log_ratio = torch.tensor(LOGPS, dtype=torch.float64) - torch.tensor(OLD, dtype=torch.float64)
    adv = torch.tensor(ADV).unsqueeze(1)
    assert stats["low_clipped"].tolist() == ((log_ratio < -eps[0]) & (adv < 0)).tolist()
    assert stats["high_clipped"].tolist() == ((log_ratio > eps[1]) & (adv > 0)).tolist()
    # The loss -rho * A: gradient flows only through unclipped tokens.
    (-(rho * torch.tensor(ADV, dtype=torch.float64))).sum().backward()
    assert logps.grad[0, 0] == 0.0  # r = 0.6 > eps_high with A > 0: clipped, no gradient
    assert logps.grad[3].abs().sum() == 0.0  # no loss tokens


def test_config_defaults_and_default_output_dir(model_path, prompts):
    args = GMPOConfig(output_dir="x")
    assert args.epsilon == 0.4 and args.epsilon_high is None and args.loss_type == "dapo"
    trainer = GMPOTrainer(model=model_path, reward_funcs=reward_len, train_dataset=prompts)
    assert type(trainer.args) is GMPOConfig
    assert trainer.args.output_dir.endswith("tiny-Qwen2ForCausalLM-GMPO")
    assert trainer._tag_names == ["trl", "gmpo"] and trainer._name == "GRPO"
    assert trainer.epsilon_low == trainer.epsilon_high == 0.4


def test_trains_logs_and_evaluates(tmp_path, model_path, prompts):
    args = make_args(tmp_path, per_device_eval_batch_size=4, beta=0.04, num_iterations=2, max_steps=3)
    trainer = GMPOTrainer(
        model=model_path,
        reward_funcs=reward_len,
        args=args,
        train_dataset=prompts,
        eval_dataset=prompts.select([0, 1]),
    )
    train_and_check_metrics(trainer, [*GMPO_METRICS, "kl"])
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_top_entropy_quantile_trains(tmp_path, model_path, prompts):
    args = make_args(tmp_path, top_entropy_quantile=0.5, max_steps=1, per_device_eval_batch_size=4)
    trainer = GMPOTrainer(
        model=model_path,
        reward_funcs=reward_len,
        args=args,
        train_dataset=prompts,
        eval_dataset=prompts.select([0, 1]),
    )
    train_and_check_metrics(trainer, GMPO_METRICS)


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(
        GMPOTrainer, args, tmp_path, model=model_path, reward_funcs=reward_len, train_dataset=prompts
    )


def test_bad_input_is_refused_before_training(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="num_generations"):
        make_args(tmp_path, num_generations=3, per_device_train_batch_size=4)
    with pytest.raises(TypeError, match="GRPOConfig"):
        GMPOTrainer(model=model_path, reward_funcs=reward_len, args=object(), train_dataset=prompts)
    with pytest.raises(ValueError, match="train_dataset"):
        GMPOTrainer(model=model_path, reward_funcs=reward_len, args=make_args(tmp_path))


def test_plain_grpo_config_is_accepted(tmp_path, model_path, prompts):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), **GROUP_ARGS, report_to="none")
    trainer = GMPOTrainer(model=model_path, reward_funcs=reward_len, args=args, train_dataset=prompts)
    assert trainer.epsilon_low == 0.2

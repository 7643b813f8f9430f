"""MiniLLMTrainer: the reverse-KL advantage and the clipped token loss against hand-written loops, training with
TRL's metric keys, save/reload/resume, the default config and bad input."""

import pytest
import torch
from trainer_utils import (
    GROUP_ARGS,
    args_builder,
    assert_saved_model_reloads,
    changed_params,
    resume_from_first_checkpoint,
    snapshot,
    train_logs,
)
from transformers import AutoModelForCausalLM

from trl.assets import get_model_path
from trl.experimental.minillm import MiniLLMConfig, MiniLLMTrainer
from trl.experimental.minillm.minillm_trainer import reverse_kl_advantage, token_clipped_loss


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(MiniLLMConfig, **GROUP_ARGS)
TEACHER = get_model_path("tiny-Qwen2ForCausalLM")


def _hand_advantage(student, teacher, mask, gamma, normalise):
    out = []
    for s_row, t_row, m_row in zip(student, teacher, mask):
        r = [(t - s) * m for s, t, m in zip(s_row, t_row, m_row)]
        if gamma == 0:
            out.append(r)
            continue
        row = []
        for t in range(len(r)):
            total = sum(gamma**k * r[k] for k in range(t, len(r)))
            weight = sum(gamma**k * (m_row[k] if m_row[k] else 1e-4) for k in range(t, len(r)))
            row.append(total / weight if normalise else total)
        out.append(row)
    return out


@pytest.mark.parametrize("gamma, normalise", [(0.0, True), (0.5, False), (0.5, True), (1.0, True)])
def test_reverse_kl_advantage_matches_hand_loop(gamma, normalise):
    student = [[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.0, -2.0, -0.7]]
    teacher = [[-1.5, -1.0, -0.5, -2.0], [-0.4, -0.3, -2.5, -1.0]]
    mask = [[1, 1, 1, 0], [0, 1, 1, 1]]
    got = reverse_kl_advantage(
        torch.tensor(student, dtype=torch.float64),
        torch.tensor(teacher, dtype=torch.float64),
        torch.tensor(mask),
        gamma,
        normalise,
    )
    expected = torch.tensor(_hand_advantage(student, teacher, mask, gamma, normalise), dtype=torch.float64)
    torch.testing.assert_close(got, expected)


def test_reverse_kl_advantage_values_observed_under_trl():
    # gamma = 0.5 without normalisation: S_t = sum_{t' >= t} 0.5^t' r_t' (absolute powers), checked against TRL 1.12.
    r = torch.tensor([[1.0, 2.0, 4.0, 8.0]], dtype=torch.float64)
    got = reverse_kl_advantage(torch.zeros_like(r), r, torch.tensor([[0, 1, 1, 1]]), 0.5, False)
    assert got.tolist() == [[3.0, 3.0, 2.0, 1.0]]


def test_token_clipped_loss():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.9]])
    adv = torch.tensor([[1.0, -1.0]])
    loss, ratio, stats = token_clipped_loss(logps, old, adv, 0.2, 0.2)
    r = torch.exp(logps.detach() - old)
    expected = [-min(r[0, 0] * 1.0, min(max(r[0, 0], 0.8), 1.2) * 1.0), -min(-r[0, 1], -min(max(r[0, 1], 0.8), 1.2))]
    torch.testing.assert_close(loss.detach(), torch.tensor([expected]))
    assert stats["high_clipped"].tolist() == [[True, False]] and stats["low_clipped"].tolist() == [[False, False]]


def test_config_defaults_and_default_output_dir(model_path, prompts):
    args = MiniLLMConfig(output_dir="x")
    assert (args.disable_dropout, args.rkl_advantage, args.single_step_decomposition) == (True, True, True)
    assert (args.kd_temperature, args.gamma, args.length_normalization) == (1.0, 0.0, True)
    trainer = MiniLLMTrainer(model=model_path, teacher_model=TEACHER, train_dataset=prompts)
    assert trainer.args.output_dir.endswith("tiny-Qwen2ForCausalLM-MiniLLM")
    assert trainer._tag_names == ["trl", "minillm"] and trainer.reward_func_names == ["dummy_reward_func"]
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())


def test_trains_logs_and_evaluates(tmp_path, model_path, prompts):
    teacher = AutoModelForCausalLM.from_pretrained(get_model_path("small-Qwen2ForCausalLM"))
    args = make_args(tmp_path, gamma=0.5, per_device_eval_batch_size=4)
    trainer = MiniLLMTrainer(
        model=model_path, teacher_model=teacher, args=args, train_dataset=prompts, eval_dataset=prompts.select([0, 1])
    )
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    last = train_logs(trainer)[-1]
    for key in ("reward", "rewards/dummy_reward_func/mean", "entropy", "clip_ratio/region_mean"):
        assert key in last, key
    assert "eval_loss" in trainer.evaluate()
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(
        MiniLLMTrainer, args, tmp_path, model=model_path, teacher_model=TEACHER, train_dataset=prompts
    )


def test_bad_input_is_refused_before_training(tmp_path, model_path, prompts):
    with pytest.raises(TypeError, match="MiniLLMConfig"):
        MiniLLMTrainer(model=model_path, teacher_model=TEACHER, args=object(), train_dataset=prompts)
    with pytest.raises(ValueError, match="num_generations"):
        make_args(tmp_path, num_generations=3, per_device_train_batch_size=4)


def test_several_iterations_per_batch_train(tmp_path, model_path, prompts):
    # TRL 1.12 fails here (a second backward through the first pass's graph); each pass recomputes its terms.
    args = make_args(tmp_path, num_iterations=2, max_steps=2)
    trainer = MiniLLMTrainer(model=model_path, teacher_model=TEACHER, args=args, train_dataset=prompts)
    trainer.train()
    assert len(train_logs(trainer)) == 2

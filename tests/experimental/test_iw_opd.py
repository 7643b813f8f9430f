"""IW-OPD configuration rules and its loss against a hand-written formula."""

import math
import warnings

import pytest
import torch

from trl.experimental.iw_opd import IWOPDConfig
from trl.experimental.iw_opd.iw_opd_trainer import build_teacher_request_inputs, iw_opd_loss
from trl.trainer.utils import sparse_divergence


def _config(tmp_path, **kwargs):
    return IWOPDConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **kwargs)


def test_defaults_and_derived_fields(tmp_path):
    args = _config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=2)
    assert (args.learning_rate, args.beta, args.lmbda, args.distillation_objective) == (1e-6, 1.0, 1.0, "iw_opd")
    assert (args.max_prompt_length, args.generation_batch_size) == (1024 - 512, 4)
    assert build_teacher_request_inputs is sparse_divergence.build_teacher_request_inputs


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lmbda=1.5), "lmbda"),
        (dict(distillation_objective="kl"), "distillation_objective"),
        (dict(iw_opd_gamma=-1.0), "iw_opd_gamma"),
        (dict(iw_opd_epsilon=0.0), "iw_opd_epsilon"),
        (dict(max_completion_length=2000), "max_completion_length"),
        (dict(per_device_train_batch_size=3, num_generations=2), "generation_batch_size"),
        (dict(lmbda=0.5), "lmbda=1.0"),
        (dict(use_vllm=True, vllm_sync_frequency=2), "vllm_sync_frequency"),
        (dict(use_teacher_server=True), "teacher_model_server_url"),
        (dict(use_teacher_server=True, teacher_model_server_url="u", distillation_objective="jsd", loss_top_k=2), "1"),
    ],
)
def test_invalid_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **kwargs)


def test_argmax_without_effect_warns(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _config(tmp_path, distillation_objective="jsd", reverse_kl_top_1_mode="argmax", beta=0.0)
    assert any("has no effect" in str(w.message) for w in caught)


def test_iw_opd_loss_matches_hand_formula():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -9.0]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -2.5, -0.2], [-0.1, -1.0, float("nan")]])
    sampler = torch.tensor([[-1.1, -2.1, -0.4], [-0.2, -1.4, -3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    gamma = 0.5
    loss, metrics = iw_opd_loss(student, teacher, sampler, mask, gamma=gamma)
    expected, weights, advantages = 0.0, [], []
    for row in range(2):
        a = [teacher[row, t].item() - sampler[row, t].item() for t in range(3) if mask[row, t]]
        total = max(sum(abs(x) for x in a), 1e-8)
        prefix = 0.0
        for t, adv in enumerate(a):
            w = 1 + gamma * (1 - prefix / total)
            expected += -w * adv * student[row, t].item()
            prefix += abs(adv)
            weights.append(w)
            advantages.append(adv)
    assert loss.item() == pytest.approx(expected / 5, rel=1e-6)
    assert metrics["mean_weight"].item() == pytest.approx(sum(weights) / 5, rel=1e-6)
    assert metrics["max_weight"].item() == pytest.approx(1 + gamma)
    assert metrics["mean_abs_advantage"].item() == pytest.approx(sum(map(abs, advantages)) / 5, rel=1e-6)
    loss.backward()
    assert student.grad[1, 2] == 0 and math.isfinite(student.grad.sum().item())
    # With num_items_in_batch and no sampler: the detached student is the behaviour policy.
    loss2, _ = iw_opd_loss(student, teacher.nan_to_num(0.0), None, mask, num_items_in_batch=10)
    a = (teacher.nan_to_num(0.0) - student.detach()) * mask
    assert loss2.item() == pytest.approx(
        iw_opd_loss(student, teacher.nan_to_num(0.0), student.detach(), mask)[0].item() * 5 / 10, rel=1e-6
    )
    assert a.abs().sum() > 0


def test_iw_opd_loss_requires_teacher_log_probs_on_valid_positions():
    with pytest.raises(ValueError, match="teacher log-probability"):
        iw_opd_loss(torch.zeros(1, 2), torch.tensor([[0.0, float("-inf")]]), None, torch.ones(1, 2))

"""SDFTTrainer and the shared self-distillation losses: hand-written formulas, teacher prompts, training with TRL's
metric keys, save/reload/resume, bad input."""

import math

import pytest
import torch
from datasets import Dataset
from trainer_utils import args_builder, assert_saved_model_reloads, resume_from_first_checkpoint, train_logs

from trl.experimental.sdft import SDFTConfig, SDFTTrainer, loss_utils
from trl.experimental.sdft.sdft_trainer import teacher_prompt


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(
    SDFTConfig,
    max_steps=2,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=6,
    learning_rate=1e-2,
    gradient_checkpointing=False,
)
SDFT_METRICS = ["completions/mean_length", "self_distillation/distillation_loss", "sdft/distillation_loss"]


@pytest.fixture(scope="module")
def context_prompts():
    return Dataset.from_dict(
        {
            "prompt": ["The sky is", "Hello my", "One two", "Cats are"],
            "privileged_context": ["blue", "friend", "three", "cute"],
        }
    )


def _hand_divergence(p_s, p_t, alpha):
    if alpha == 0.0:
        return sum(t * (math.log(t) - math.log(s)) for s, t in zip(p_s, p_t))
    if alpha == 1.0:
        return sum(s * (math.log(s) - math.log(t)) for s, t in zip(p_s, p_t))
    m = [(1 - alpha) * s + alpha * t for s, t in zip(p_s, p_t)]
    kl_t = sum(t * (math.log(t) - math.log(mm)) for t, mm in zip(p_t, m))
    kl_s = sum(s * (math.log(s) - math.log(mm)) for s, mm in zip(p_s, m))
    return alpha * kl_t + (1 - alpha) * kl_s


@pytest.mark.parametrize("alpha", [0.0, 0.4, 1.0])
def test_divergence_and_topk_match_hand_formulas(alpha):
    student = torch.tensor([[[2.0, 0.5, -1.0, 0.1]]], dtype=torch.float64)
    teacher = torch.tensor([[[0.3, 1.5, -0.2, 0.0]]], dtype=torch.float64)
    p_s, p_t = student.softmax(-1)[0, 0].tolist(), teacher.softmax(-1)[0, 0].tolist()
    full = loss_utils.compute_full_logit_self_distillation_loss(student, teacher, distillation_alpha=alpha)
    assert full.item() == pytest.approx(_hand_divergence(p_s, p_t, alpha))
    # Top-2 of the student: indices 0 and 1, renormalised, or with the rest as a tail bucket.
    renorm = loss_utils.compute_topk_self_distillation_loss(
        student, teacher, distillation_topk=2, distillation_alpha=alpha, distillation_add_tail=False
    )
    s2, t2 = p_s[:2], p_t[:2]
    expected = _hand_divergence([v / sum(s2) for v in s2], [v / sum(t2) for v in t2], alpha)
    assert renorm.item() == pytest.approx(expected)
    tail = loss_utils.compute_topk_self_distillation_loss(
        student, teacher, distillation_topk=2, distillation_alpha=alpha, distillation_add_tail=True
    )
    assert tail.item() == pytest.approx(_hand_divergence([*s2, 1 - sum(s2)], [*t2, 1 - sum(t2)], alpha))


def test_sampled_token_loss_and_importance_clip():
    student = torch.tensor([[[2.0, 0.5, -1.0]]], requires_grad=True)
    teacher = torch.tensor([[[0.3, 1.5, -0.2]]])
    ids = torch.tensor([[1]])
    loss = loss_utils.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=1.0)
    ls, lt = student.log_softmax(-1)[0, 0, 1].item(), teacher.log_softmax(-1)[0, 0, 1].item()
    assert loss.item() == pytest.approx((ls - lt) * ls, rel=1e-5)
    with pytest.raises(ValueError, match="reverse KL"):
        loss_utils.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=0.5)
    clipped = loss_utils.apply_importance_sampling_clipping(
        torch.ones(1, 3), torch.tensor([[0.0, -1.0, 5.0]]), torch.tensor([[-0.5, -1.0, 0.0]]), 1.3
    )
    assert clipped[0].tolist() == pytest.approx([1.3, 1.0, 1.3])
    tail = loss_utils.add_tail_bucket(torch.log(torch.tensor([0.2, 0.5])))
    assert tail.exp().tolist() == pytest.approx([0.2, 0.5, 0.3])


def test_teacher_prompts():
    template = "{prompt}\n\n{privileged_context}"
    assert teacher_prompt("Q?", "ctx", template) == "Q?\n\nctx"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    built = teacher_prompt(
        messages, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], template
    )
    assert built == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?\n\na\nb"}]
    with pytest.raises(ValueError, match="privileged_context"):
        teacher_prompt("Q?", None, template)


def test_config_defaults_and_errors(tmp_path):
    args = SDFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert (args.distillation_mode, args.distillation_alpha, args.distillation_topk) == ("topk_logits", 0.5, 100)
    assert args.teacher_model_kind == "base" and args.num_generations == 8 and args.max_completion_length == 256
    with pytest.raises(ValueError, match="teacher_prompt_template"):
        make_args(tmp_path, teacher_prompt_template="{prompt}")
    with pytest.raises(ValueError, match="distillation_alpha=1.0"):
        make_args(tmp_path, distillation_mode="sampled_token")
    with pytest.raises(ValueError, match="divisible by num_generations"):
        make_args(tmp_path, num_generations=3)


@pytest.mark.parametrize("kind", ["base", "live", "ema"])
def test_trains_logs_and_saves(tmp_path, model_path, context_prompts, kind):
    trainer = SDFTTrainer(
        model=model_path, args=make_args(tmp_path, teacher_model_kind=kind), train_dataset=context_prompts
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    last = train_logs(trainer)[-1]
    for key in SDFT_METRICS:
        assert key in last and math.isfinite(last[key]), key
    assert "num_tokens" not in last and "step_time" not in last
    assert last["sdft/distillation_loss"] == last["self_distillation/distillation_loss"]
    if kind == "live":
        assert trainer.teacher_model is None
    else:
        assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_resume_from_checkpoint(tmp_path, model_path, context_prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(SDFTTrainer, args, tmp_path, model=model_path, train_dataset=context_prompts)


def test_bad_input_refused_before_training(tmp_path, model_path, context_prompts):
    with pytest.raises(ValueError, match="train_dataset"):
        SDFTTrainer(model=model_path, args=make_args(tmp_path))
    with pytest.raises(NotImplementedError, match="IterableDataset"):
        SDFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=context_prompts.to_iterable_dataset())


@pytest.mark.parametrize("add_tail", [True, False])
def test_topk_loss_backward_is_autograds(add_tail):
    """The top-k loss gathers its log-probabilities through `gathered_log_probs` (one buffer in the backward): the
    values and gradients of the plain gather-minus-logsumexp expression, bit for bit."""
    torch.manual_seed(8)
    student = (torch.randn(2, 3, 200) * 2).requires_grad_(True)
    teacher = torch.randn(2, 3, 200) * 2
    upstream = torch.randn(2, 3)
    loss = loss_utils.compute_topk_self_distillation_loss(
        student, teacher, distillation_topk=10, distillation_alpha=0.5, distillation_add_tail=add_tail
    )
    (grad,) = torch.autograd.grad(loss, student, upstream)
    support = student.detach().topk(10, dim=-1).indices
    if add_tail:
        student_on = loss_utils.add_tail_bucket(
            student.gather(-1, support) - torch.logsumexp(student, -1, keepdim=True)
        )
        teacher_on = loss_utils.add_tail_bucket(
            teacher.gather(-1, support) - torch.logsumexp(teacher, -1, keepdim=True)
        )
    else:
        on = student.gather(-1, support) - torch.logsumexp(student, -1, keepdim=True)
        student_on = on - torch.logsumexp(on, dim=-1, keepdim=True)
        on = teacher.gather(-1, support) - torch.logsumexp(teacher, -1, keepdim=True)
        teacher_on = on - torch.logsumexp(on, dim=-1, keepdim=True)
    plain = loss_utils.compute_divergence(student_on, teacher_on, 0.5)
    (plain_grad,) = torch.autograd.grad(plain, student, upstream)
    assert torch.equal(loss, plain) and torch.equal(grad, plain_grad)

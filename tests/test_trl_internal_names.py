"""TRL's importable internals at TRL's import paths (imported by test suites and plugins written for TRL), each checked
against a hand-written computation: `trl.trainer.sft_trainer._chunked_cross_entropy_loss` and `dft_loss`,
`trl.trainer.utils._ChunkedLogProbFunction`, `trl.models.utils.disable_gradient_checkpointing`."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from trl.assets import get_model_path


def _logits(hidden, weight, bias=None, scale=1.0, cap=None, temperature=1.0):
    z = (hidden @ weight.T + (0 if bias is None else bias)) * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z / temperature


def _entropy(logits):
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


# ---------------------------------------------------------------------------------------------------------------------
# sft_trainer._chunked_cross_entropy_loss, sft_trainer.dft_loss
# ---------------------------------------------------------------------------------------------------------------------
LABELS = torch.tensor([[-100, 3, 4, 5, 6], [-100, -100, 7, 8, -100]])


@pytest.mark.parametrize(
    "options",
    [{}, {"num_items_in_batch": 10}, {"logit_scale": 0.5, "final_logit_softcapping": 2.0, "bias": True}],
    ids=["plain", "num_items", "scale_softcap_bias"],
)
def test_chunked_cross_entropy_loss_matches_full_logits(options):
    from trl.trainer.sft_trainer import _chunked_cross_entropy_loss

    options = dict(options)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=generator, dtype=torch.float64) if options.pop("bias", False) else None
    scale, cap = options.get("logit_scale", 1.0), options.get("final_logit_softcapping")
    loss, correct, entropy_sum, count = _chunked_cross_entropy_loss(
        hidden, weight, 3, labels=LABELS, lm_head_bias=bias, **options
    )
    grads = torch.autograd.grad(loss + entropy_sum, (hidden, weight))

    # position t scored against labels[:, t + 1]
    logits = _logits(hidden[:, :-1], weight, bias, scale, cap)
    targets = LABELS[:, 1:]
    mask = targets != -100
    nll = F.cross_entropy(logits[mask], targets[mask], reduction="sum")
    expected_loss = nll / options.get("num_items_in_batch", int(mask.sum()))
    expected_entropy = _entropy(logits[mask]).sum()
    expected_grads = torch.autograd.grad(expected_loss + expected_entropy, (hidden, weight))
    assert count.dtype == torch.int64 and int(count) == 6
    assert torch.allclose(loss, expected_loss) and torch.allclose(entropy_sum, expected_entropy)
    assert float(correct) == float((logits[mask].argmax(-1) == targets[mask]).sum())
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want)


def test_chunked_cross_entropy_loss_shift_labels_and_errors():
    from trl.trainer.sft_trainer import _chunked_cross_entropy_loss

    hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
    shifted = F.pad(LABELS[:, 1:], (0, 1), value=-100)
    by_labels = _chunked_cross_entropy_loss(hidden, weight, 4, labels=LABELS)
    by_shift = _chunked_cross_entropy_loss(hidden, weight, 4, labels=torch.zeros_like(LABELS), shift_labels=shifted)
    assert torch.allclose(by_labels[0], by_shift[0])  # shift_labels wins over labels
    nothing = _chunked_cross_entropy_loss(hidden, weight, 4, labels=torch.full_like(LABELS, -100))
    assert [float(value) for value in nothing] == [0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="At least one of `labels` or `shift_labels` must be provided"):
        _chunked_cross_entropy_loss(hidden, weight, 4)


def test_dft_loss_weights_each_token_by_its_detached_probability():
    from trl.trainer.sft_trainer import dft_loss

    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)

    class Outputs:
        pass

    outputs = Outputs()
    outputs.logits = logits
    loss = dft_loss(outputs, LABELS)
    logp = logits[:, :-1].log_softmax(-1)
    targets = LABELS[:, 1:]
    mask = targets != -100
    token_logp = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)[mask]
    expected = -(token_logp * token_logp.detach().exp()).sum() / mask.sum()
    assert torch.allclose(loss, expected)
    (grad,) = torch.autograd.grad(loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(grad, expected_grad)
    assert torch.allclose(dft_loss({"logits": logits}, LABELS, num_items_in_batch=10), expected * mask.sum() / 10)
    assert torch.isnan(dft_loss(outputs, torch.full_like(LABELS, -100)))  # no target: 0 / 0, as in TRL


# ---------------------------------------------------------------------------------------------------------------------
# trainer.utils._ChunkedLogProbFunction
# ---------------------------------------------------------------------------------------------------------------------
def test_chunked_logprob_function_signature_and_outputs():
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _ChunkedLogProbFunction

    assert _ChunkedLogProbFunction is ChunkedLogProbFunction
    params = list(inspect.signature(_ChunkedLogProbFunction.forward).parameters)
    assert params == [
        "ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
        "logit_scale", "outputs",
    ]  # fmt: skip

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 6, generator=generator, requires_grad=True)
    weight = torch.randn(13, 6, generator=generator, requires_grad=True)
    bias = torch.randn(13, generator=generator, requires_grad=True)
    targets = torch.tensor([0, 3, 12, 7, 7])
    logprobs, entropy, log_sum_sq, mean_logits, is_top1 = _ChunkedLogProbFunction.apply(
        hidden, weight, bias, targets, 0.7, 4, 3.0, 0.5
    )
    assert {t.dtype for t in (logprobs, entropy, log_sum_sq, mean_logits)} == {torch.float32}
    z = _logits(hidden, weight, bias, 0.5, 3.0, 0.7)
    logp = z.log_softmax(-1)
    close = dict(rtol=1e-5, atol=1e-6)
    assert torch.allclose(logprobs, logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), **close)
    assert torch.allclose(entropy, _entropy(z), **close)
    assert torch.allclose(log_sum_sq, (2 * logp).logsumexp(-1), **close)
    assert torch.allclose(mean_logits, z.mean(-1), **close)
    assert is_top1.dtype == torch.bool and is_top1.tolist() == (z.argmax(-1) == targets).tolist()
    assert not log_sum_sq.requires_grad and not mean_logits.requires_grad

    weights = torch.arange(5.0)
    grads = torch.autograd.grad((0.3 * logprobs).sum() + (weights * entropy).sum(), (hidden, weight, bias))
    expected = (0.3 * logp.gather(-1, targets.unsqueeze(-1))).sum() + (weights * _entropy(z)).sum()
    for got, want in zip(grads, torch.autograd.grad(expected, (hidden, weight, bias))):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)

    only_logprobs = _ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 8, None, 1.0, ())
    assert only_logprobs[1:] == (None, None, None, None)
    # ties: the first maximum is the argmax
    tied = _ChunkedLogProbFunction.apply(torch.zeros(2, 6), torch.zeros(13, 6), None, torch.tensor([0, 4]), 1.0, 4)
    assert tied[4].tolist() == [True, False]


# ---------------------------------------------------------------------------------------------------------------------
# models.utils.disable_gradient_checkpointing
# ---------------------------------------------------------------------------------------------------------------------
def test_disable_gradient_checkpointing_restores_with_the_given_kwargs():
    from trl.models.utils import disable_gradient_checkpointing

    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    with disable_gradient_checkpointing(model) as value:  # not checkpointing: left alone
        assert value is None and not model.is_gradient_checkpointing
    assert not model.is_gradient_checkpointing

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with disable_gradient_checkpointing(model, {"use_reentrant": False}):
        assert not model.is_gradient_checkpointing
    assert model.is_gradient_checkpointing
    assert model.model.layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    with pytest.raises(RuntimeError), disable_gradient_checkpointing(model):
        raise RuntimeError("the block failed")
    assert model.is_gradient_checkpointing

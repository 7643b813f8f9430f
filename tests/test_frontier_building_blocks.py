"""TRL 1.16's building blocks: `trl.kernels.ChunkedDivergenceFunction` against the full-vocabulary formula (values and
gradients), `add_fused_lm_head` against the model's own logits, TRL's `selective_log_softmax_and_entropy`
signature, selective activation checkpointing (the model wrapper and SFT's switch), the small `trl.trainer.utils`
helpers."""

import asyncio
import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from trl import SFTConfig, SFTTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
from trl.models import enable_selective_activation_checkpointing
from trl.trainer import add_fused_lm_head
from trl.trainer.fast_paths.fused_lm_head import resolve_logit_scale
from trl.trainer.utils import (
    FusedCausalLMOutput,
    global_then_local_main_first,
    maybe_gather_lm_head_ctx,
    selective_log_softmax_and_entropy,
    shutdown_event_loop_in_daemon,
    start_event_loop_in_daemon,
)


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------------------------------
# ChunkedDivergenceFunction
# ---------------------------------------------------------------------------------------------------------------------
def full_vocab_divergence(student_logits, teacher_logits, beta, temperature):
    """The generalized JSD written out over the whole vocabulary (float64)."""
    log_s = torch.log_softmax(student_logits / temperature, -1)
    log_t = torch.log_softmax(teacher_logits / temperature, -1)
    if beta == 0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.log((1 - beta) * log_s.exp() + beta * log_t.exp())
    return beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1 - beta) * (log_s.exp() * (log_s - log_m)).sum(-1)


def transform(logits, scale, cap):
    z = logits * scale
    return z if cap is None else cap * torch.tanh(z / cap)


@pytest.mark.parametrize(
    "beta, temperature, scale, cap", [(0.0, 1.0, 1.0, None), (1.0, 0.8, 1.0, None), (0.4, 1.3, 0.5, 3.0)]
)
def test_chunked_divergence_matches_full_vocabulary_formula(beta, temperature, scale, cap):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(13, generator=g, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    teacher_weight = torch.randn(13, 5, generator=g, dtype=torch.float64)
    upstream = torch.randn(6, generator=g, dtype=torch.float64)

    divergence, entropy = ChunkedDivergenceFunction.apply(
        hidden, weight, bias, teacher_hidden, teacher_weight, None, beta, temperature, scale, cap, 2.0, None
    )
    grads = torch.autograd.grad((divergence * upstream).sum(), (hidden, weight, bias))

    student_logits = transform(F.linear(hidden, weight, bias), scale, cap)
    teacher_logits = transform(teacher_hidden.detach() @ teacher_weight.T, 2.0, None)
    expected = full_vocab_divergence(student_logits, teacher_logits, beta, temperature)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (hidden, weight, bias))
    log_s = torch.log_softmax(student_logits / temperature, -1)

    assert divergence.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(divergence, expected.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, -(log_s.exp() * log_s).sum(-1).float(), rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert not entropy.requires_grad
    assert teacher_hidden.grad is None


def test_chunked_divergence_refuses_bad_inputs():
    hidden, weight = torch.randn(2, 4), torch.randn(7, 4)
    with pytest.raises(ValueError, match="beta"):
        ChunkedDivergenceFunction.apply(hidden, weight, None, hidden, weight, None, 1.5)
    with pytest.raises(ValueError, match="vocabulary"):
        ChunkedDivergenceFunction.apply(hidden, weight, None, hidden, torch.randn(8, 4), None, 0.5)


# ---------------------------------------------------------------------------------------------------------------------
# add_fused_lm_head
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def fused_model():
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    signature = inspect.signature(model.forward)
    add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy", "is_top1", "mean_logits"))
    return model, signature


def test_fused_forward_matches_the_models_logits(fused_model):
    model, signature = fused_model
    assert inspect.signature(model.forward) == signature  # generate validates kwargs against it
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert isinstance(out, FusedCausalLMOutput) and out.log_sum_sq_probs is None
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1] / 0.8
    log_p = torch.log_softmax(logits, -1)
    mask = labels[:, 1:] != -100
    expected = log_p.gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1) * mask
    torch.testing.assert_close(out.log_probs, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.label_mask, mask)
    entropy = -(log_p.exp() * log_p).sum(-1) * mask
    torch.testing.assert_close(out.entropy, entropy, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.is_top1, (logits.argmax(-1) == labels[:, 1:]) & mask)
    torch.testing.assert_close(out.mean_logits, logits.mean(-1) * mask, rtol=1e-5, atol=1e-6)
    assert out.loss.item() == pytest.approx(-(expected.sum() / mask.sum()).item(), rel=1e-5)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None


def test_fused_forward_options_and_passthrough(fused_model):
    model, _ = fused_model
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(1))
    shifted = model(input_ids=ids, shift_labels=ids, num_items_in_batch=10, fused_lm_head=True)
    assert shifted.log_probs.shape == (1, 5)
    assert shifted.loss.item() == pytest.approx(-shifted.log_probs.sum().item() / 10, rel=1e-6)
    plain = model(input_ids=ids, labels=ids)
    assert type(plain).__name__ == "CausalLMOutputWithPast" and plain.logits.shape == (1, 5, model.config.vocab_size)
    assert model.generate(input_ids=ids, max_new_tokens=2, do_sample=False).shape == (1, 7)
    with pytest.raises(ValueError, match="needs `labels`"):
        model(input_ids=ids, fused_lm_head=True)


def test_fused_lm_head_refuses_unknown_outputs():
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    with pytest.raises(ValueError, match="outputs must be taken from"):
        add_fused_lm_head(model, outputs=("log_probs", "logits"))


def test_logit_scale_resolution_order():
    class Config:
        pass

    config = Config()
    assert resolve_logit_scale(config) == 1.0
    config.logits_scaling = 4.0
    assert resolve_logit_scale(config) == 0.25
    config.model_type = "hyperclovax"
    assert resolve_logit_scale(config) == 4.0
    config.lm_head_multiplier = 3.0
    assert resolve_logit_scale(config) == 3.0
    config.logit_scale = 0.5
    assert resolve_logit_scale(config) == 0.5


def test_maybe_gather_lm_head_ctx_is_a_null_context_without_zero3():
    weight = torch.nn.Parameter(torch.ones(2))
    with maybe_gather_lm_head_ctx(weight, None, weight):
        assert weight.sum().item() == 2.0


# ---------------------------------------------------------------------------------------------------------------------
# trl.trainer.utils helpers with TRL's signatures
# ---------------------------------------------------------------------------------------------------------------------
def test_selective_log_softmax_and_entropy_has_trls_signature():
    logits = torch.randn(2, 3, 11, requires_grad=True)
    index = torch.randint(0, 11, (2, 3))
    logps, entropy = selective_log_softmax_and_entropy(logits, index, False, 0.5)
    log_p = torch.log_softmax(logits / 0.5, -1)
    torch.testing.assert_close(logps, log_p.gather(-1, index[..., None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1))
    assert logps.requires_grad and not entropy.requires_grad
    _, with_grad = selective_log_softmax_and_entropy(logits, index)
    assert with_grad.requires_grad


def test_event_loop_in_daemon_runs_coroutines_and_shuts_down():
    thread, loop, ready = start_event_loop_in_daemon(name="trl-test-loop")
    assert ready.wait(5) and thread.daemon and thread.name == "trl-test-loop"

    async def add(a, b):
        return a + b

    assert asyncio.run_coroutine_threadsafe(add(2, 3), loop).result(timeout=5) == 5
    shutdown_event_loop_in_daemon(thread, loop)
    assert not thread.is_alive() and loop.is_closed()
    shutdown_event_loop_in_daemon(None, None)  # nothing started: nothing to do


def test_global_then_local_main_first_runs_the_block_on_one_process():
    ran = []
    with global_then_local_main_first():
        ran.append(True)
    assert ran == [True]


# ---------------------------------------------------------------------------------------------------------------------
# Selective activation checkpointing
# ---------------------------------------------------------------------------------------------------------------------
def test_selective_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 6))
    grads = {}
    for selective in (False, True):
        model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
        if selective:
            enable_selective_activation_checkpointing(model)
            wrapper = model.gradient_checkpointing_enable
            enable_selective_activation_checkpointing(model)  # idempotent
            assert model.gradient_checkpointing_enable is wrapper and wrapper._is_sac_wrapped
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"selective": True} if selective else None)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads[selective] = [p.grad.clone() for p in model.parameters()]
    for plain, selective in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(plain, selective)


def _sft(tmp_path, **config):
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none", **config)
    data = load_test_dataset("standard_language_modeling", split="train").select(range(4))
    return SFTTrainer(get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=data)


def test_sft_selective_switch_wraps_and_trains(tmp_path):
    trainer = _sft(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True})
    assert trainer.model.gradient_checkpointing_enable._is_sac_wrapped
    assert trainer.args.gradient_checkpointing_kwargs == {"selective": True}
    trainer.train()
    off = _sft(tmp_path / "off", gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": False})
    assert off.args.gradient_checkpointing_kwargs == {}


@pytest.mark.parametrize(
    "config, match",
    [
        (
            dict(gradient_checkpointing=False, gradient_checkpointing_kwargs={"selective": True}),
            "requires `gradient_checkpointing=True`",
        ),
        (
            dict(
                gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True, "use_reentrant": True}
            ),
            "use_reentrant",
        ),
    ],
)
def test_sft_selective_switch_refuses_bad_combinations(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        _sft(tmp_path, **config)

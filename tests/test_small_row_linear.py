"""Decode steps' linear layers of a few rows computed as `W @ xᵀ` (`trl/trainer/fast_paths/small_row_linear.py`)
against `F.linear`: equal to float rounding where the path applies, bit for bit where it does not, and the same
rollouts as `generate`."""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GenerationConfig

from trl.assets import get_model_path
from trl.trainer.fast_paths import small_row_linear as module
from trl.trainer.fast_paths.rollout_decode import decode_rollouts
from trl.trainer.fast_paths.small_row_linear import small_row_linear, small_row_linear_fallback_reason
from trl.trainer.online_generation import generate_with_shared_prompts


class _TwoLayers(nn.Module):
    """A projection and an LM-head-like output layer (what `get_output_embeddings` returns)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 96)
        self.head = nn.Linear(64, 500, bias=False)

    def get_output_embeddings(self):
        return self.head


# Why the path does not apply on this machine (an environment switch, a torch build without MKL), or None.
NOT_HERE = small_row_linear_fallback_reason(torch.device("cpu"), torch.float32)
needs_the_path = pytest.mark.skipif(NOT_HERE is not None, reason=f"small_row_linear does not apply here: {NOT_HERE}")


@pytest.fixture
def layers():
    torch.manual_seed(0)
    return _TwoLayers()


@pytest.fixture
def taken(monkeypatch):
    """The `(rows, max_rows)` of every call the path considered, and whether it applied."""
    seen = []
    original = module._applies

    def spy(inputs, weight, max_rows):
        applies = original(inputs, weight, max_rows)
        seen.append((inputs.numel() // inputs.shape[-1], max_rows, applies))
        return applies

    monkeypatch.setattr(module, "_applies", spy)
    return seen


@needs_the_path
@pytest.mark.parametrize("shape", [(2, 64), (3, 1, 64), (4, 64), (2, 2, 64)])
def test_few_rows_equal_linear_to_float_rounding(layers, taken, shape):
    x = torch.randn(*shape)
    with torch.no_grad():
        expected_proj, expected_head = layers.proj(x), layers.head(x)
        with small_row_linear(layers):
            proj, head = layers.proj(x), layers.head(x)
    assert all(applies for *_, applies in taken) and len(taken) == 2
    for got, expected in ((proj, expected_proj), (head, expected_head)):
        assert got.shape == expected.shape and got.is_contiguous()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@needs_the_path
def test_the_head_takes_up_to_8_rows_other_weights_4(layers, taken):
    with torch.no_grad(), small_row_linear(layers):
        for rows in (5, 8, 9):
            x = torch.randn(rows, 64)
            layers.proj(x), layers.head(x)
    assert taken == [
        (5, 4, False),
        (5, 8, True),
        (8, 4, False),
        (8, 8, True),
        (9, 4, False),
        (9, 8, False),
    ]


def test_calls_left_alone_are_bitwise_linear(layers):
    cases = [torch.randn(1, 64), torch.randn(6, 64), torch.randn(2, 64, dtype=torch.float64)]
    context = small_row_linear(layers)
    for x in cases:
        with torch.no_grad():
            weight = layers.proj.weight.to(x.dtype)
            expected = F.linear(x, weight)
            with context:  # the same context entered call after call
                got = F.linear(x, weight)
        assert torch.equal(got, expected)
    # With autograd recording, the plain kernel runs (and the gradient flows as usual).
    x = torch.randn(2, 64, requires_grad=True)
    with context:
        got = layers.proj(x)
    assert torch.equal(got, layers.proj(x)) and got.grad_fn is not None


def test_fallback_reasons(monkeypatch):
    monkeypatch.delenv("TRL_SMALL_ROW_LINEAR", raising=False)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert "meta" in small_row_linear_fallback_reason(meta, torch.float32)
    assert "bfloat16" in small_row_linear_fallback_reason(cpu, torch.bfloat16)
    monkeypatch.setenv("TRL_SMALL_ROW_LINEAR", "0")
    assert "TRL_SMALL_ROW_LINEAR" in small_row_linear_fallback_reason(cpu, torch.float32)
    # Switched off, or for a model without parameters, the context changes nothing.
    assert isinstance(small_row_linear(nn.Linear(8, 8)), contextlib.nullcontext)
    monkeypatch.delenv("TRL_SMALL_ROW_LINEAR")
    assert isinstance(small_row_linear(nn.Module()), contextlib.nullcontext)


@needs_the_path
@pytest.mark.parametrize("do_sample", [False, True])
def test_rollouts_equal_generate_with_the_path(taken, do_sample):
    """Two rows in flight: the decode takes the path at every layer and gives `generate`'s tokens and random stream."""
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM")).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size - 10, (1, 12), generator=generator)
    mask, rows = torch.ones_like(ids), torch.tensor([0, 0])
    config = GenerationConfig(max_new_tokens=12, do_sample=do_sample, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(1)
    reference = generate_with_shared_prompts(model, ids, mask, rows, config)
    after_reference = torch.rand(3)
    torch.manual_seed(1)
    output = decode_rollouts(model, ids, mask, rows, config)
    assert torch.equal(output.sequences, reference) and torch.equal(torch.rand(3), after_reference)
    assert any(applies for *_, applies in taken)


@needs_the_path
def test_the_generate_fallback_takes_the_path_and_samples_the_same_tokens(monkeypatch, taken):
    """The online trainers' `generate` (here the rollout fallback) runs under the path: same tokens as with it off."""
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM")).eval()
    ids = torch.randint(10, model.config.vocab_size - 10, (2, 10), generator=torch.Generator().manual_seed(0))
    mask, rows = torch.ones_like(ids), torch.tensor([0, 1])
    config = GenerationConfig(max_new_tokens=10, do_sample=True, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(2)
    with_path = generate_with_shared_prompts(model, ids, mask, rows, config, rollout_decode=False)
    assert any(applies for *_, applies in taken)
    monkeypatch.setenv("TRL_SMALL_ROW_LINEAR", "0")
    torch.manual_seed(2)
    without = generate_with_shared_prompts(model, ids, mask, rows, config, rollout_decode=False)
    assert torch.equal(with_path, without)

"""compute_token_logps: per-token log-probs against a full log-softmax, padded and padding-free, with gradients."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl.assets import get_model_path
from trl.trainer.utils import compute_token_logps


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM")).eval()


def _reference(model, input_ids, attention_mask=None, temperature=1.0):
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1), logprobs


def test_padded_with_target_mask(model):
    torch.manual_seed(1)
    input_ids = torch.randint(0, 4000, (3, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    target_mask = torch.zeros(3, 11, dtype=torch.bool)
    target_mask[:, 5:] = True
    target_mask[1, 8:] = False
    result = compute_token_logps(model, input_ids, attention_mask, target_mask=target_mask, compute_entropy=True)
    expected, logprobs = _reference(model, input_ids, attention_mask)
    torch.testing.assert_close(result.logps, expected * target_mask, atol=1e-5, rtol=1e-5)
    entropy = -(logprobs.exp() * logprobs).sum(-1) * target_mask
    torch.testing.assert_close(result.entropy, entropy, atol=1e-5, rtol=1e-5)


def test_temperature(model):
    input_ids = torch.randint(0, 4000, (2, 8))
    result = compute_token_logps(model, input_ids, temperature=0.7)
    expected, _ = _reference(model, input_ids, temperature=0.7)
    torch.testing.assert_close(result.logps, expected, atol=1e-5, rtol=1e-5)


def test_padding_free_equals_separate_sequences(model):
    first, second = torch.randint(0, 4000, (1, 7)), torch.randint(0, 4000, (1, 5))
    packed = torch.cat([first, second], dim=1)
    position_ids = torch.cat([torch.arange(7), torch.arange(5)])[None]
    result = compute_token_logps(model, packed, position_ids=position_ids)
    alone_first, _ = _reference(model, first)
    alone_second, _ = _reference(model, second)
    torch.testing.assert_close(result.logps[:, :6], alone_first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.logps[:, 7:], alone_second, atol=1e-5, rtol=1e-5)


def test_gradients_flow(model):
    model.train()
    input_ids = torch.randint(0, 4000, (2, 6))
    target_mask = torch.ones(2, 5, dtype=torch.bool)
    compute_token_logps(model, input_ids, target_mask=target_mask).logps.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad()
    model.eval()


def test_vocabulary_mean_and_sum_of_logits_from_hidden_states(model):
    """`mean_logits_from_hidden` / `summed_logits_from_hidden` equal the mean / sum of the full logits (here with an
    LM-head bias too, which the tiny model does not have)."""
    from trl.trainer.utils.logprobs import mean_logits_from_hidden, summed_logits_from_hidden

    torch.manual_seed(2)
    input_ids = torch.randint(0, 4000, (2, 7))
    with torch.no_grad():
        outputs = model(input_ids=input_ids, output_hidden_states=True)
    hidden, logits = outputs.hidden_states[-1], outputs.logits.double()
    assert torch.allclose(summed_logits_from_hidden(model, hidden).double(), logits.sum(-1), rtol=1e-5, atol=1e-3)
    assert torch.allclose(mean_logits_from_hidden(model, hidden).double(), logits.mean(-1), rtol=1e-5, atol=1e-6)
    head = model.get_output_embeddings()
    bias = torch.randn(head.out_features)
    expected = logits.sum(-1) + bias.double().sum()
    head.bias = torch.nn.Parameter(bias)
    try:
        assert torch.allclose(summed_logits_from_hidden(model, hidden).double(), expected, rtol=1e-5, atol=1e-3)
    finally:
        head.bias = None

"""Value-head models: forward outputs, dropout/init options, generate, save/load with and without PEFT."""

import os

import pytest
import torch
from peft import LoraConfig
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from trl.assets import get_model_path
from trl.experimental.ppo import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PreTrainedModelWrapper,
)


CAUSAL = "tiny-Qwen2ForCausalLM"
SEQ2SEQ = "tiny-T5ForConditionalGeneration"


@pytest.fixture(scope="module")
def causal():
    return AutoModelForCausalLMWithValueHead.from_pretrained(get_model_path(CAUSAL)).eval()


def test_causal_forward_returns_float32_logits_loss_and_one_value_per_token(causal):
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    logits, loss, values = causal(ids)
    assert logits.dtype == torch.float32 and logits.shape == (2, 4, causal.config.vocab_size)
    assert loss is None and values.shape == (2, 4)
    hidden = causal.pretrained_model(ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(values, causal.v_head.summary(hidden).squeeze(-1))
    _, loss, _ = causal(ids, labels=ids)
    assert loss is not None and loss.ndim == 0
    out = causal(ids, return_past_key_values=True)
    assert len(out) == 4 and out[3] is not None


def test_generate_passes_through(causal):
    ids = torch.tensor([[1, 2, 3]])
    expected = causal.pretrained_model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(causal.generate(ids, max_new_tokens=3, do_sample=False), expected)


def test_value_head_options():
    path = get_model_path(CAUSAL)
    default = AutoModelForCausalLMWithValueHead.from_pretrained(path)
    assert isinstance(default.v_head.dropout, torch.nn.Dropout) and default.v_head.dropout.p == 0.1
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        path, summary_dropout_prob=0.0, v_head_init_strategy="normal", v_head_initializer_range=0.5
    )
    assert isinstance(model.v_head.dropout, torch.nn.Identity)
    assert model.v_head.summary.bias.abs().sum().item() == 0.0
    assert 0.3 < model.v_head.summary.weight.std().item() < 0.7
    with pytest.raises(ValueError, match="v_head_init_strategy"):
        AutoModelForCausalLMWithValueHead.from_pretrained(path, v_head_init_strategy="xavier")


def test_save_writes_the_head_into_the_weight_file_and_reloads(causal, tmp_path):
    causal.save_pretrained(tmp_path)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= set(keys)
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    assert torch.equal(reloaded.v_head.summary.weight, causal.v_head.summary.weight)
    # The saved folder also loads as a plain causal LM.
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert torch.equal(plain.lm_head.weight, causal.pretrained_model.lm_head.weight)
    assert "v_head.summary.weight" in causal.state_dict()


def test_from_an_instance_and_without_saved_head(causal):
    base = AutoModelForCausalLM.from_pretrained(get_model_path(CAUSAL))
    model = AutoModelForCausalLMWithValueHead.from_pretrained(base)
    assert model.pretrained_model is base and isinstance(model, PreTrainedModelWrapper)
    assert not model.is_peft_model


def test_peft_round_trip(tmp_path):
    path = get_model_path(CAUSAL)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(
        path, peft_config=LoraConfig(r=4, target_modules=["q_proj"])
    )
    assert model.is_peft_model
    assert list(model.state_dict()) == ["v_head.summary.weight", "v_head.summary.bias"]
    model.save_pretrained(str(tmp_path))
    assert {"adapter_config.json", "adapter_model.safetensors", "pytorch_model.bin"} <= set(os.listdir(tmp_path))
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    assert reloaded.is_peft_model
    assert torch.equal(reloaded.v_head.summary.weight, model.v_head.summary.weight)
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(reloaded.eval()(ids)[2], model.eval()(ids)[2])


def test_seq2seq_forward_values_per_decoder_position():
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(get_model_path(SEQ2SEQ)).eval()
    logits, loss, values = model(input_ids=torch.tensor([[1, 2, 3, 4]]), decoder_input_ids=torch.tensor([[0, 5]]))
    assert logits.shape[:2] == (1, 2) and values.shape == (1, 2) and loss is None


def test_model_without_lm_head_is_rejected():
    from transformers import AutoModel

    base = AutoModel.from_pretrained(get_model_path(CAUSAL))
    with pytest.raises(ValueError, match="language-model head"):
        AutoModelForCausalLMWithValueHead(base)


def test_reward_score_needs_a_reward_adapter(causal):
    with pytest.raises(ValueError, match="reward adapter"):
        causal.compute_reward_score(torch.tensor([[1, 2]]))

"""Adapters on a bitsandbytes-quantized base (QLoRA), for real on the CPU, and the reference of a `PeftModel` passed
in: how each trainer sets them up (`trl/models/peft.py`), and the LM head kept in another dtype than its input."""

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.kernels.linear_log_softmax import linear_selective_log_softmax
from trl.models.peft import AS_LOADED, BF16_ADAPTERS, KBIT_PREPARED, REFERENCE_ADAPTER, prepare_peft_model
from trl.trainer.utils.logprobs import fusable_lm_head


MODEL = "tiny-Qwen2ForCausalLM"


def lora(**overrides) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], **overrides)


def quantized(dtype=torch.float32):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (`pip install trl[quantization]`)")
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(get_model_path(MODEL), quantization_config=config, dtype=dtype)


def dtypes(model, trainable: bool) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if p.requires_grad == trainable and p.dtype != torch.uint8}


@pytest.mark.parametrize(
    ("mode", "trainable", "frozen"),
    [
        (BF16_ADAPTERS, {torch.bfloat16}, {torch.bfloat16}),  # the base as loaded, adapters in bf16
        (AS_LOADED, {torch.float32}, {torch.bfloat16}),  # the base as loaded, fp32 adapters
        (KBIT_PREPARED, {torch.float32}, {torch.float32}),  # peft's k-bit preparation upcasts the base
    ],
)
def test_quantized_base_modes(mode, trainable, frozen):
    args = SFTConfig(output_dir="unused", gradient_checkpointing=True, report_to="none")
    model = prepare_peft_model(quantized(torch.bfloat16), lora(task_type="CAUSAL_LM"), args, quantized_base=mode)
    assert dtypes(model, True) == trainable
    assert dtypes(model, False) == frozen


def test_unknown_quantized_base_mode_is_refused():
    args = SFTConfig(output_dir="unused", report_to="none")
    with pytest.raises(ValueError, match="quantized_base must be one of"):
        prepare_peft_model(AutoModelForCausalLM.from_pretrained(get_model_path(MODEL)), lora(), args, "fp8")


def test_sft_casts_adapters_of_a_quantized_peft_model_passed_in(tmp_path):
    model = get_peft_model(quantized(), lora(task_type="CAUSAL_LM"))
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", bf16=False, use_cpu=True)
    trainer = SFTTrainer(model, args=args, train_dataset=load_test_dataset("standard_language_modeling", "train"))
    assert dtypes(trainer.model, True) == {torch.bfloat16}
    assert dtypes(trainer.model, False) == {torch.float32}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)


def test_head_in_another_dtype_than_its_input_computes_in_the_wider():
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 8), torch.randn(11, 8).to(torch.bfloat16)
    index = torch.randint(0, 11, (5,))
    logps, _, _ = linear_selective_log_softmax(hidden, weight, index)
    expected = torch.log_softmax(F.linear(hidden, weight.float()), dim=-1).gather(-1, index[:, None]).squeeze(-1)
    torch.testing.assert_close(logps, expected)


def test_fused_head_reads_the_active_modules_to_save_copy():
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(get_model_path(MODEL)),
        lora(task_type="CAUSAL_LM", modules_to_save=["lm_head"]),
    )
    wrapper = model.get_output_embeddings()
    assert fusable_lm_head(model) is wrapper.modules_to_save["default"]
    with model.disable_adapter():
        assert fusable_lm_head(model) is wrapper.original_module


def test_sft_evaluates_a_bf16_modules_to_save_head_on_an_fp32_base(tmp_path):
    """Evaluation computes the logits with the bf16 trained copy of the head in fp32 (the wider dtype), as the fused
    head does in training, instead of failing in the head's product."""
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", bf16=False, use_cpu=True)
    dataset = load_test_dataset("standard_language_modeling", "train").select(range(8))
    peft_config = lora(task_type="CAUSAL_LM", modules_to_save=["lm_head"])
    trainer = SFTTrainer(quantized(), args=args, train_dataset=dataset, eval_dataset=dataset, peft_config=peft_config)
    head = trainer.model.get_output_embeddings().modules_to_save["default"]
    assert head.weight.dtype == torch.bfloat16
    trainer.train()
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    assert "forward" not in vars(head)  # the head's own forward again after the evaluation


def trained_adapter():
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(get_model_path(MODEL)), lora(task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    return model


def test_dpo_reference_of_a_peft_model_passed_in_is_its_adapter_at_the_start(tmp_path):
    model = trained_adapter()
    data = load_test_dataset("standard_preference", "train").select(range(4))
    args = DPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        learning_rate=0.0,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        gradient_checkpointing=False,  # transformers 4.x's reentrant checkpoint needs input grads a given model lacks
    )
    trainer = DPOTrainer(model, args=args, train_dataset=data)
    assert sorted(trainer.model.peft_config) == ["default", REFERENCE_ADAPTER]
    assert trainer.model.active_adapter == "default"
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if f".{REFERENCE_ADAPTER}." in n)
    trainer.train()
    logs = trainer.state.log_history[0]
    # Policy and reference are the same adapter at the first step: the implicit rewards are 0 (not the adapter's
    # effect against the base model).
    assert logs["rewards/chosen"] == 0.0 and logs["rewards/rejected"] == 0.0


def test_dpo_with_a_peft_config_keeps_the_adapters_disabled_as_reference(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(get_model_path(MODEL))
    data = Dataset.from_list(list(load_test_dataset("standard_preference", "train").select(range(2))))
    args = DPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    trainer = DPOTrainer(model, args=args, train_dataset=data, peft_config=lora(task_type="CAUSAL_LM"))
    assert list(trainer.model.peft_config) == ["default"]


def test_reward_model_on_an_fp32_quantized_base_is_refused_before_training(tmp_path):
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (`pip install trl[quantization]`)")
    from transformers import AutoModelForSequenceClassification, BitsAndBytesConfig

    from trl import RewardConfig, RewardTrainer

    def reward_model(dtype):
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)
        return AutoModelForSequenceClassification.from_pretrained(
            get_model_path(MODEL), num_labels=1, quantization_config=quantization, dtype=dtype
        )

    data = load_test_dataset("standard_preference", "train").select(range(4))
    args = RewardConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=r"score head is trained in torch.bfloat16 .* base computes in torch.float32"):
        RewardTrainer(
            reward_model(torch.float32), args=args, train_dataset=data, peft_config=lora(task_type="SEQ_CLS")
        )
    # A bf16 base trains.
    trainer = RewardTrainer(
        reward_model(torch.bfloat16), args=args, train_dataset=data, peft_config=lora(task_type="SEQ_CLS")
    )
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] > 0

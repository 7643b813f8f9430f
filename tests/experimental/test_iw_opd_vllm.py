"""IW-OPD with the student sampling through a colocated vLLM engine (`make test-vllm`: the vLLM environment)."""

import math

import pytest
import torch

from trl.assets import get_model_path, load_test_dataset
from trl.import_utils import is_vllm_available


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)"),
]


def test_vllm_samples_and_behaviour_log_probs(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer

    args = IWOPDConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no", max_steps=2,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_length=96, max_completion_length=6,
        learning_rate=1e-3, logging_steps=1, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=256, gradient_checkpointing=False,
    )  # fmt: skip
    data = load_test_dataset("conversational_language_modeling", split="train").select(range(8))
    trainer = IWOPDTrainer(
        get_model_path("tiny-Qwen2ForCausalLM"),
        get_model_path("small-Qwen2ForCausalLM"),
        args=args,
        train_dataset=data,
    )
    versions, seen = [], []
    generate, compute_loss = trainer.vllm_generation.generate, trainer.compute_loss

    def recording_generate(prompt_ids, model=None, weights_version=None):
        versions.append(weights_version)
        return generate(prompt_ids, model=model, weights_version=weights_version)

    def recording_loss(model, inputs, *rest, **kwargs):
        if not seen:  # the first slice: the trainer's weights are the ones vLLM sampled with
            with torch.no_grad():
                logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            own = logits[:, :-1].float().log_softmax(-1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
            labelled = inputs["labels"][:, 1:] != -100
            # vLLM's log-probs of its samples are the trainer's own (same weights, temperature 1), up to a constant
            # ~0.05: vLLM normalises over the tokenizer's tokens only, the tiny model's padded vocabulary is larger.
            assert torch.allclose(own[labelled], inputs["rollout_logprobs"][:, 1:][labelled], atol=0.1)
        seen.append(inputs)
        return compute_loss(model, inputs, *rest, **kwargs)

    trainer.vllm_generation.generate, trainer.compute_loss = recording_generate, recording_loss
    trainer.train()
    assert versions == [0, 0, 1, 1]  # two slices per step, weights pushed once per step
    for inputs in seen:
        labelled = inputs["labels"] != -100
        sampled = inputs["rollout_logprobs"]
        assert (sampled[~labelled] == 0).all() and (sampled[labelled] < 0).all()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["iw_opd/mean_weight"]) for log in logs)
    trainer.vllm_generation.close()

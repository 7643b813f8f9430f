"""Gradient-accumulation invariance: one optimizer step over the same examples gives the same loss and the same
gradients whether they come as one micro-batch of 4 or as 2 accumulated micro-batches of 2.

The step is plain SGD at learning rate 1 without clipping, so the parameter change is exactly minus the gradient.
Covered where TRL's normalisation makes the two equal: token-level losses divided by the token count of the whole
accumulated batch (SFT's `nll`, GRPO's `dapo`), sequence-level means over equal micro-batches (DPO, Reward, GRPO's
`grpo`, RLOO). Not covered, because TRL's own definition depends on the micro-batch: KTO and BCO (the KL / reward
reference point is estimated per micro-batch), GRPO's `bnpo` (normalised per micro-batch), and Online DPO, XPO and
Nash-MD (they generate per micro-batch, so the two runs sample different completions).
"""

import pytest
import torch

from trl.assets import get_model_path, load_test_dataset


pytestmark = pytest.mark.reliability

STEP = dict(
    max_steps=1,
    optim="sgd",
    learning_rate=1.0,
    max_grad_norm=1e9,
    lr_scheduler_type="constant",
    report_to="none",
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
    seed=7,
)


def _build(name, output_dir, batch_size, accumulation):
    batching = dict(per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation)
    lm = get_model_path("tiny-Qwen2ForCausalLM")
    if name == "sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(output_dir, max_length=32, **batching, **STEP)
        return SFTTrainer(lm, args=args, train_dataset=load_test_dataset("standard_language_modeling", "train"))
    if name == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(output_dir, max_length=32, **batching, **STEP)
        return DPOTrainer(lm, args=args, train_dataset=load_test_dataset("standard_preference", "train"))
    if name == "reward":
        from trl import RewardConfig, RewardTrainer

        args = RewardConfig(output_dir, max_length=32, **batching, **STEP)
        model = get_model_path("tiny-Qwen2ForSequenceClassification")
        return RewardTrainer(model, args=args, train_dataset=load_test_dataset("standard_preference", "train"))

    def low_id_reward(completion_ids, **kwargs):
        return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    prompts = load_test_dataset("standard_prompt_only", "train")
    online = dict(num_generations=2, max_completion_length=6, **batching, **STEP)
    if name.startswith("grpo"):
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(output_dir, loss_type=name.split("-")[1], **online)
        return GRPOTrainer(lm, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    if name == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        args = RLOOConfig(output_dir, **online)
        return RLOOTrainer(lm, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    raise ValueError(name)


def _step(trainer):
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    update = {name: before[name] - p.detach() for name, p in trainer.model.named_parameters()}
    loss = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
    return loss, update


@pytest.mark.parametrize("name", ["sft", "dpo", "reward", "grpo-dapo", "grpo-grpo", "rloo"])
def test_accumulated_micro_batches_give_the_same_loss_and_gradients(tmp_path, name):
    loss_full, update_full = _step(_build(name, str(tmp_path / "one"), batch_size=4, accumulation=1))
    loss_accumulated, update_accumulated = _step(_build(name, str(tmp_path / "two"), batch_size=2, accumulation=2))
    assert loss_accumulated == pytest.approx(loss_full, rel=1e-5, abs=1e-6)
    changed = 0
    for key, value in update_full.items():
        torch.testing.assert_close(update_accumulated[key], value, rtol=1e-4, atol=1e-6, msg=key)
        changed += bool(value.abs().max() > 0)
    assert changed > 0

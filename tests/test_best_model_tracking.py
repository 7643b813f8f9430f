"""Metrics added by a trainer reach transformers' callers: `evaluate()`'s return value and best-model tracking.

The trainers record their own metrics (`rewards/accuracies`, `mean_token_accuracy`, ...) and add them in `log()`; the
dict transformers passes to `log()` is the one `evaluate()` returns and `metric_for_best_model` is read from, so the
metrics must be added to it in place.
"""

import pytest
from trainer_utils import COMMON_ARGS

from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from trl.assets import get_model_path, load_test_dataset


pytestmark = pytest.mark.usefixtures("single_thread")

CASES = {
    "sft": (SFTTrainer, SFTConfig, "tiny-Qwen2ForCausalLM", "standard_language_modeling", "eval_mean_token_accuracy"),
    "dpo": (DPOTrainer, DPOConfig, "tiny-Qwen2ForCausalLM", "standard_preference", "eval_rewards/accuracies"),
    "kto": (KTOTrainer, KTOConfig, "tiny-Qwen2ForCausalLM", "standard_unpaired_preference", "eval_rewards/chosen"),
    "reward": (
        RewardTrainer,
        RewardConfig,
        "tiny-Qwen2ForSequenceClassification",
        "standard_preference",
        "eval_accuracy",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_load_best_model_at_end_on_a_trainer_metric(tmp_path, name):
    trainer_class, config_class, model, dataset_name, metric = CASES[name]
    dataset = load_test_dataset(dataset_name)
    args = config_class(
        output_dir=str(tmp_path),
        **{**COMMON_ARGS, "save_strategy": "steps"},
        max_steps=2,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=1,
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model=metric,
    )
    trainer = trainer_class(
        get_model_path(model), args=args, train_dataset=dataset["train"], eval_dataset=dataset["test"]
    )
    trainer.train()
    assert trainer.state.best_metric is not None
    assert trainer.state.best_model_checkpoint is not None
    metrics = trainer.evaluate()
    assert metric in metrics, sorted(metrics)
    assert "epoch" in metrics
    evals = [log for log in trainer.state.log_history if metric in log]
    assert len(evals) >= 2  # one per evaluation during training, plus the final evaluate()

"""SSDTrainer: the stub filter and the cross-entropy against hand-written rules, training with TRL's metric keys,
save/reload/resume, the default config and bad input."""

import math

import pytest
import torch
from trainer_utils import (
    args_builder,
    assert_saved_model_reloads,
    resume_from_first_checkpoint,
    train_and_check_metrics,
)

from trl.experimental.ssd import SSDConfig, SSDTrainer
from trl.experimental.ssd.ssd_trainer import is_substantive, masked_token_mean_nll


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(
    SSDConfig, max_steps=2, per_device_train_batch_size=2, max_completion_length=6, learning_rate=1e-2, seed=0
)
SSD_METRICS = [
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "ssd/active_sample_ratio",
    "ssd/cross_entropy_loss",
]


@pytest.mark.parametrize(
    "text, kept",
    [
        ("", False),
        ("   \n  ", False),
        ("return 12", False),  # one line, 9 characters
        ("return 123", True),  # one line, 10 characters
        ("  abcdefghij  ", True),
        ("a\nb", True),  # several lines, however short
        ("\na\n", False),  # stripped: one short line
        ("def f():\n    pass", True),
    ],
)
def test_filter_rule(text, kept):
    assert is_substantive(text) is kept


def test_cross_entropy_matches_hand_formula():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -1.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss = masked_token_mean_nll(logps, mask)
    assert loss.item() == pytest.approx((1.0 + 2.0 + 0.5 + 4.0 + 1.5) / 5)
    empty = masked_token_mean_nll(logps, torch.zeros_like(mask))
    assert empty.item() == 0.0 and empty.requires_grad


def test_config_defaults_and_default_output_dir(model_path, prompts):
    args = SSDConfig(output_dir="x")
    assert (args.filter_empty, args.top_k, args.temperature, args.max_prompt_length) == (True, 0, 1.0, 512)
    assert args.steps_per_generation == 1 and args.generation_batch_size == args.per_device_train_batch_size
    trainer = SSDTrainer(model=model_path, train_dataset=prompts)
    assert trainer.args.output_dir.endswith("tiny-Qwen2ForCausalLM-SSD")
    assert trainer._tag_names == ["trl", "ssd"] and trainer._name == "SSD"


def test_trains_logs_and_evaluates(tmp_path, model_path, prompts):
    args = make_args(tmp_path, filter_empty=False, temperature=0.8)
    trainer = SSDTrainer(model=model_path, args=args, train_dataset=prompts, eval_dataset=prompts.select([0, 1]))
    evaluation = train_and_check_metrics(trainer, SSD_METRICS)
    assert evaluation["eval_ssd/active_sample_ratio"] == 1.0
    assert math.isclose(evaluation["eval_loss"], evaluation["eval_ssd/cross_entropy_loss"], rel_tol=1e-6)
    last = [log for log in trainer.state.log_history if "loss" in log][-1]
    assert set(last) >= set(SSD_METRICS) and "reward" not in last and "num_tokens" not in last
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_stub_completions_are_left_out(tmp_path, model_path, prompts):
    # Two-token completions decode to short single lines: every one is filtered, the loss is a zero.
    args = make_args(tmp_path, max_completion_length=2, max_steps=1)
    trainer = SSDTrainer(model=model_path, args=args, train_dataset=prompts)
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["ssd/active_sample_ratio"] == 0.0 and log["loss"] == 0.0 and log["completions/max_length"] == 0.0


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1, filter_empty=False)
    resume_from_first_checkpoint(SSDTrainer, args, tmp_path, model=model_path, train_dataset=prompts)


def test_bad_input_is_refused_before_training(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="can not be both configured at the same time"):
        make_args(tmp_path, generation_batch_size=4, steps_per_generation=2)
    with pytest.raises(TypeError, match="SSDConfig"):
        SSDTrainer(model=model_path, args=object(), train_dataset=prompts)
    with pytest.raises(ValueError, match="prompt"):
        SSDTrainer(model=model_path, args=make_args(tmp_path), train_dataset=prompts.rename_column("prompt", "q"))

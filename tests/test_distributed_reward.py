"""Reward modelling with two CPU processes (gloo, DDP): the pair-averaged Bradley-Terry loss must give the losses,
gradients and weights of one process on the whole global batch, with metrics reduced over both ranks.
Helpers: tests/distributed_utils.py.
"""

import pytest
from distributed_utils import (
    COMPARISON_LR,
    assert_data_parallel_run,
    assert_matches_single_process,
    assert_metrics_reduced,
    assert_same_weights,
    comparison_args,
    engine_params,
    launch,
    load_weights,
    rank_report,
    recording,
    run_single,
    step1_weights_callback,
    write_report,
)


pytestmark = pytest.mark.distributed

PER_DEVICE_BATCH = 2
METRICS = ["accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"]


def train_reward(out_dir: str, per_device_batch: int = PER_DEVICE_BATCH) -> None:
    """Worker: a few plain-SGD reward-model steps on the tiny classifier; writes this rank's report to `out_dir`."""
    from trl import RewardConfig, RewardTrainer
    from trl.assets import get_model_path, load_test_dataset

    args = comparison_args(RewardConfig, out_dir, per_device_batch)
    step1 = step1_weights_callback()
    trainer = recording(RewardTrainer)(
        model=get_model_path("tiny-Qwen2ForSequenceClassification"),
        args=args,
        train_dataset=load_test_dataset("standard_preference", split="train"),
        callbacks=[step1],
    )
    step1.trainer = trainer
    trainer.train()
    write_report(out_dir, rank_report(trainer, trainer.seen_rows, step1))


@pytest.mark.parametrize("engine", engine_params(["ddp"]))
def test_reward_two_processes_match_one(engine, tmp_path):
    single = run_single(train_reward, tmp_path / "single", per_device_batch=2 * PER_DEVICE_BATCH)
    reports = launch(f"{__file__}:train_reward", tmp_path / engine, engine)
    assert_data_parallel_run(reports, engine)
    assert_matches_single_process(reports, single, lr=COMPARISON_LR)
    assert_same_weights(load_weights(reports[0]), load_weights(single), atol=1e-4, what="final weights")
    # metrics are computed on the gathered rewards of both ranks: equal everywhere, and equal to the single run's
    assert_metrics_reduced(reports, single, METRICS, tol=1e-5)

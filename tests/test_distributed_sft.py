"""SFT with two CPU processes (gloo) under DDP, DeepSpeed ZeRO-2/ZeRO-3 and FSDP2.

Every engine must train one model on disjoint halves of each global batch, with the losses, gradients and weights of
a single process trained on the whole global batch. Launch helpers: tests/distributed_utils.py.
"""

import pytest
from distributed_utils import (
    COMPARISON_LR,
    assert_data_parallel_run,
    assert_matches_single_process,
    assert_same_weights,
    comparison_args,
    engine_params,
    launch,
    load_weights,
    rank_report,
    record_saves,
    recording,
    run_single,
    step1_weights_callback,
    write_report,
)


pytestmark = pytest.mark.distributed

PER_DEVICE_BATCH = 2
MAX_STEPS = 3


def train_sft(out_dir: str, per_device_batch: int = PER_DEVICE_BATCH, save: bool = False) -> None:
    """Worker: a few plain-SGD SFT steps on the tiny model; writes this rank's report to `out_dir`."""
    from trl import SFTConfig, SFTTrainer
    from trl.assets import get_model_path, load_test_dataset

    args = comparison_args(
        SFTConfig,
        out_dir,
        per_device_batch,
        max_steps=MAX_STEPS,
        save_strategy="steps" if save else "no",
        save_steps=MAX_STEPS,
    )
    step1 = step1_weights_callback()
    trainer = recording(SFTTrainer)(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=args,
        train_dataset=load_test_dataset("standard_language_modeling", split="train"),
        callbacks=[step1],
    )
    step1.trainer = trainer
    with record_saves() as saves:
        trainer.train()
    write_report(out_dir, rank_report(trainer, trainer.seen_rows, step1, extra={"saves": saves}))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same training in this (single) process, on the global batch of the 2-process runs."""
    return run_single(train_sft, tmp_path_factory.mktemp("sft_single"), per_device_batch=2 * PER_DEVICE_BATCH)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2-process runs, launched once per engine and shared by the tests of this module."""
    cache = {}

    def get(engine: str):
        if engine not in cache:
            out = tmp_path_factory.mktemp(f"sft_{engine}")
            cache[engine] = (out, launch(f"{__file__}:train_sft", out, engine, save=engine == "zero3"))
        return cache[engine]

    return get


@pytest.mark.parametrize("engine", engine_params())
def test_sft_two_processes_match_one(engine, runs, single):
    _, reports = runs(engine)
    assert_data_parallel_run(reports, engine)
    assert_matches_single_process(reports, single, lr=COMPARISON_LR)
    assert_same_weights(load_weights(reports[0]), load_weights(single), atol=1e-4, what="final weights")
    # metrics are reduced over the ranks before logging: every rank logs the same numbers
    keys = ("loss", "grad_norm", "num_tokens", "entropy", "mean_token_accuracy")
    assert [{k: log[k] for k in keys} for log in reports[0]["logs"]] == [
        {k: log[k] for k in keys} for log in reports[1]["logs"]
    ]
    # token counts and token-level metrics cover both ranks: the single run's values on the same global batches
    assert [log["num_tokens"] for log in reports[0]["logs"]] == [log["num_tokens"] for log in single["logs"]]
    for got, want in zip(reports[0]["logs"], single["logs"]):
        assert got["mean_token_accuracy"] == pytest.approx(want["mean_token_accuracy"], abs=1e-6)
        assert got["entropy"] == pytest.approx(want["entropy"], abs=1e-4)


@pytest.mark.parametrize("engine", engine_params(["zero3"]))
def test_sft_zero3_checkpoint_reloads_into_plain_model(engine, runs):
    import torch
    from transformers import AutoModelForCausalLM

    out, reports = runs(engine)
    # only the main process writes weights and the model card
    assert "weights" in reports[0]["saves"] and "model_card" in reports[0]["saves"]
    assert reports[1]["saves"] == []
    model = AutoModelForCausalLM.from_pretrained(out / f"checkpoint-{MAX_STEPS}", dtype=torch.float32)
    # consolidated: every parameter at full size, equal to the gathered trained weights
    reloaded = {name: param.detach() for name, param in model.named_parameters()}
    assert_same_weights(reloaded, load_weights(reports[0]), atol=0.0, what="reloaded ZeRO-3 checkpoint")

"""DPO with two CPU processes (gloo) under DDP, DeepSpeed ZeRO-2/ZeRO-3 and FSDP2, with a separate reference model.

The pair-averaged DPO loss must give the losses, gradients and weights of one process on the whole global batch. The
reference model is prepared like the policy (a ZeRO-3 inference engine, FSDP2 shards) and pulled towards the policy
by `sync_ref_model` (gathering sharded parameters); precomputed reference log-probs work under ZeRO-3. Helpers:
tests/distributed_utils.py.
"""

import pytest
from distributed_utils import (
    COMPARISON_LR,
    assert_data_parallel_run,
    assert_matches_single_process,
    assert_metrics_reduced,
    assert_reference_prepared,
    assert_same_weights,
    comparison_args,
    engine_params,
    gathered_parameters,
    launch,
    load_weights,
    model_facts,
    rank_report,
    recording,
    run_single,
    step1_weights_callback,
    write_report,
)


pytestmark = pytest.mark.distributed

PER_DEVICE_BATCH = 2
PAIR_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"]
PAIR_METRICS += ["logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens"]
# The reference is blended into the policy after step 2, so step 3's loss depends on the synced reference.
SYNC = {"sync_ref_model": True, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5}


def train_dpo(out_dir: str, per_device_batch: int = PER_DEVICE_BATCH, sync: bool = True, precompute: bool = False):
    """Worker: a few plain-SGD DPO steps on the tiny model; writes this rank's report to `out_dir`."""
    from trl import DPOConfig, DPOTrainer
    from trl.assets import get_model_path, load_test_dataset

    options = dict(SYNC) if sync else {}
    args = comparison_args(DPOConfig, out_dir, per_device_batch, precompute_ref_log_probs=precompute, **options)
    step1 = step1_weights_callback()
    trainer = recording(DPOTrainer)(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=args,
        train_dataset=load_test_dataset("standard_preference", split="train"),
        callbacks=[step1],
    )
    step1.trainer = trainer
    trainer.train()
    extra = {"precomputed": "ref_chosen_logps" in trainer.train_dataset.column_names}
    if trainer.ref_model is not None:
        extra.update(model_facts(trainer.ref_model, "ref"))
        extra["_ref"] = gathered_parameters(trainer.ref_model)
    write_report(out_dir, rank_report(trainer, trainer.seen_rows, step1, extra=extra))


def train_dpo_bema(out_dir: str, per_device_batch: int = PER_DEVICE_BATCH) -> None:
    """Worker: DPO whose reference is refreshed from a BEMA of the policy (experimental BEMA-reference trainer)."""
    from trl import DPOConfig
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

    args = comparison_args(DPOConfig, out_dir, per_device_batch)
    step1 = step1_weights_callback()
    bema = BEMACallback(update_freq=1, lag=1, update_ref_model=True, ref_model_update_freq=2)
    trainer = recording(DPOTrainer)(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=args,
        train_dataset=load_test_dataset("standard_preference", split="train"),
        callbacks=[step1, bema],
    )
    step1.trainer = trainer
    trainer.train()
    extra = {"_ref": gathered_parameters(trainer.ref_model), "_bema": dict(bema.running_model.named_parameters())}
    write_report(out_dir, rank_report(trainer, trainer.seen_rows, step1, extra=extra))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_single(train_dpo, tmp_path_factory.mktemp("dpo_single"), per_device_batch=2 * PER_DEVICE_BATCH)


@pytest.mark.parametrize("engine", engine_params())
def test_dpo_two_processes_match_one(engine, tmp_path, single):
    reports = launch(f"{__file__}:train_dpo", tmp_path, engine)
    assert_data_parallel_run(reports, engine)
    assert_matches_single_process(reports, single, lr=COMPARISON_LR)
    assert_same_weights(load_weights(reports[0]), load_weights(single), atol=1e-4, what="final weights")
    assert_metrics_reduced(reports, single, PAIR_METRICS, tol=1e-4)
    assert_reference_prepared(reports, engine)
    # sync_ref_model blended the (gathered) policy into the reference exactly as in one process
    assert_same_weights(load_weights(reports[0], "ref"), load_weights(single, "ref"), atol=1e-5, what="reference")


@pytest.mark.parametrize("engine", engine_params(["zero3"]))
def test_dpo_zero3_precomputed_reference(engine, tmp_path):
    """Reference log-probs computed before training by a ZeRO-3 reference engine, each rank scoring its share."""
    single = run_single(train_dpo, tmp_path / "single", per_device_batch=2 * PER_DEVICE_BATCH, sync=False)
    reports = launch(f"{__file__}:train_dpo", tmp_path / engine, engine, sync=False, precompute=True)
    assert_data_parallel_run(reports, engine)
    assert all(report["precomputed"] for report in reports)
    assert "ref_wrapper" not in reports[0]  # the reference model is released once the data is scored
    assert_matches_single_process(reports, single, lr=COMPARISON_LR)
    assert_metrics_reduced(reports, single, PAIR_METRICS, tol=1e-4)


@pytest.mark.parametrize("engine", engine_params(["zero3", "fsdp2"]))
def test_dpo_bema_reference_on_sharded_engines(engine, tmp_path):
    """BEMACallback averages the gathered policy weights and writes them into the sharded reference model."""
    from transformers import AutoModelForCausalLM

    single = run_single(train_dpo_bema, tmp_path / "single", per_device_batch=2 * PER_DEVICE_BATCH)
    reports = launch(f"{__file__}:train_dpo_bema", tmp_path / engine, engine)
    assert_data_parallel_run(reports, engine)
    # the reference changes after step 2, so step 3's loss checks the refreshed (sharded) reference too
    assert_matches_single_process(reports, single, lr=COMPARISON_LR)
    assert_same_weights(load_weights(reports[0], "bema"), load_weights(single, "bema"), atol=1e-5, what="BEMA")
    assert_same_weights(load_weights(reports[0], "ref"), load_weights(single, "ref"), atol=1e-5, what="reference")
    # the averaged model was saved once, by the main process, in full
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / engine / "bema")
    assert_same_weights(
        {name: param.detach() for name, param in saved.named_parameters()},
        load_weights(reports[0], "bema"),
        atol=0.0,
        what="saved BEMA model",
    )

"""KTO with two CPU processes (gloo) under DDP, DeepSpeed ZeRO-2/ZeRO-3 and FSDP2, with a separate reference model.

The example-averaged KTO loss must give the losses, gradients and weights of one process on the whole global batch.
The KL reference point is the one value shared by all processes (the mean of the ranks' batch estimates, which with
equal per-rank batches is the estimate over the global batch), so it must equal the single-process value. The
reference model is prepared like the policy (a ZeRO-3 inference engine, FSDP2 shards) and pulled towards the policy
by `sync_ref_model` (gathering sharded parameters); precomputed reference log-probs (completions and KL completions)
work under ZeRO-3. Helpers: tests/distributed_utils.py.
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


# The data holds 24 desirable and 40 undesirable examples; the trainer's advice on class weights is expected here.
pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:The training data has:UserWarning")]

PER_DEVICE_BATCH = 2
# Logged every step (the sequential sampler and the alternating labels of the data put both classes in every batch).
METRICS = ["kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]
METRICS += ["logits/chosen", "logits/rejected", "entropy", "num_tokens"]
# The reference is blended into the policy after step 2, so step 3's loss depends on the synced reference.
SYNC = {"sync_ref_model": True, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5}


def kto_trainer_class():
    """KTOTrainer pairing the KL completions within chunks of `PER_DEVICE_BATCH` rows in every run.

    The trainer pairs them within chunks of `per_device_train_batch_size` (with the sequential sampler, a chunk is a
    rank's batch). The single-process run has twice the per-device batch, so without this its KL completions would
    come from other neighbours than the 2-process runs', and the two runs would not train on the same data.
    """
    from trl import KTOTrainer

    class FixedKLChunks(KTOTrainer):
        @staticmethod
        def _kl_chunk_size(args, dataset_name):
            return PER_DEVICE_BATCH

    return recording(FixedKLChunks)


def save_sharpened_reference(path: str) -> str:
    """Save the tiny model with its final-norm weights multiplied by 10 (sharper logits) as a reference model.

    The untrained tiny model is almost uniform over its vocabulary; a copy of it as the reference would make the KL
    reference point `max(0, mean(log pi - log pi_ref))` clamp to 0 in a few small steps. Against a sharper
    reference, the policy gives the (mostly unlikely) KL completions more probability than the reference, so the KL
    point is positive at every step and its reduction across ranks is really compared.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl.assets import get_model_path

    source = get_model_path("tiny-Qwen2ForCausalLM")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def train_kto(
    out_dir: str,
    ref_path: str,
    per_device_batch: int = PER_DEVICE_BATCH,
    sync: bool = True,
    precompute: bool = False,
):
    """Worker: a few plain-SGD KTO steps on the tiny model; writes this rank's report to `out_dir`."""
    from trl import KTOConfig
    from trl.assets import get_model_path, load_test_dataset

    options = dict(SYNC) if sync else {}
    # beta=1: the KL reference point moves the loss visibly (with the default 0.1 it hardly matters)
    args = comparison_args(
        KTOConfig, out_dir, per_device_batch, beta=1.0, precompute_ref_log_probs=precompute, **options
    )
    step1 = step1_weights_callback()
    trainer = kto_trainer_class()(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        ref_model=ref_path,
        args=args,
        train_dataset=load_test_dataset("standard_unpaired_preference", split="train"),
        callbacks=[step1],
    )
    step1.trainer = trainer
    trainer.train()
    columns = trainer.train_dataset.column_names
    extra = {"precomputed": "ref_logps" in columns and "ref_KL_logps" in columns}
    if trainer.ref_model is not None:
        extra.update(model_facts(trainer.ref_model, "ref"))
        extra["_ref"] = gathered_parameters(trainer.ref_model)
    write_report(out_dir, rank_report(trainer, trainer.seen_rows, step1, extra=extra))


@pytest.fixture(scope="module")
def ref_path(tmp_path_factory):
    return save_sharpened_reference(str(tmp_path_factory.mktemp("kto_reference")))


@pytest.fixture(scope="module")
def single(tmp_path_factory, ref_path):
    out = tmp_path_factory.mktemp("kto_single")
    return run_single(train_kto, out, ref_path=ref_path, per_device_batch=2 * PER_DEVICE_BATCH)


def assert_kto_metrics_reduced(reports, single):
    """Metrics, the KL reference point included, are reduced over the ranks: equal on both, equal to one process."""
    assert_metrics_reduced(reports, single, METRICS, tol=1e-4)
    # a KL reference point that is positive at every step, so its reduction is really compared
    assert all(logs["kl"] > 1e-3 for logs in single["logs"])


@pytest.mark.parametrize("engine", engine_params())
def test_kto_two_processes_match_one(engine, tmp_path, ref_path, single):
    reports = launch(f"{__file__}:train_kto", tmp_path, engine, ref_path=ref_path)
    assert_data_parallel_run(reports, engine)
    assert_matches_single_process(reports, single, lr=COMPARISON_LR)
    assert_same_weights(load_weights(reports[0]), load_weights(single), atol=1e-4, what="final weights")
    assert_kto_metrics_reduced(reports, single)
    assert_reference_prepared(reports, engine)
    # sync_ref_model blended the (gathered) policy into the reference exactly as in one process
    assert_same_weights(load_weights(reports[0], "ref"), load_weights(single, "ref"), atol=1e-5, what="reference")


@pytest.mark.parametrize("engine", engine_params(["zero3"]))
def test_kto_zero3_precomputed_reference(engine, tmp_path, ref_path):
    """Reference log-probs of completions and KL completions computed before training by a ZeRO-3 reference engine,
    each rank scoring its share of the dataset."""
    single = run_single(
        train_kto, tmp_path / "single", ref_path=ref_path, per_device_batch=2 * PER_DEVICE_BATCH, sync=False
    )
    reports = launch(
        f"{__file__}:train_kto", tmp_path / engine, engine, ref_path=ref_path, sync=False, precompute=True
    )
    assert_data_parallel_run(reports, engine)
    assert all(report["precomputed"] for report in reports)
    assert "ref_wrapper" not in reports[0]  # the reference model is released once the data is scored
    assert_matches_single_process(reports, single, lr=COMPARISON_LR)
    assert_kto_metrics_reduced(reports, single)

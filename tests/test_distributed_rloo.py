"""RLOO with two CPU processes (gloo) under DDP, DeepSpeed ZeRO-3 and FSDP2.

A group of `num_generations` completions spans both ranks here (4 completions, 2 per rank), so the leave-one-out
baseline needs the rewards of the other rank, and the sequence-level KL penalty in the reward needs its KL values.
With fixed completions (a rollout function), the losses, gradients, weights and metrics must be those of one process
on the whole global batch, with the KL reference model prepared like the policy. Helpers: tests/distributed_utils.py.
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
    fixed_rollout,
    launch,
    length_reward,
    load_weights,
    model_facts,
    rank_report,
    run_single,
    step1_weights_callback,
    write_report,
)


pytestmark = pytest.mark.distributed

PER_DEVICE_BATCH = 2
NUM_GENERATIONS = 4  # one group per step, split over the two ranks
# Computed on the gathered batch: equal to the single-process values.
GLOBAL_METRICS = ["num_tokens", "completions/mean_length", "completions/min_length", "completions/max_length"]
GLOBAL_METRICS += ["reward", "reward_std", "frac_reward_zero_std", "kl"]
# Per-process means averaged over the processes: equal on every rank.
PROCESS_MEAN_METRICS = ["entropy", "clip_ratio/region_mean"]


def train_rloo(out_dir: str, per_device_batch: int = PER_DEVICE_BATCH) -> None:
    """Worker: a few plain-SGD RLOO steps on the tiny model with fixed completions; writes this rank's report."""
    from trl import RLOOConfig, RLOOTrainer
    from trl.assets import get_model_path, load_test_dataset

    args = comparison_args(
        RLOOConfig,
        out_dir,
        per_device_batch,
        num_generations=NUM_GENERATIONS,
        max_completion_length=6,
        beta=0.1,
        normalize_advantages=True,  # over the whole generation batch: needs every rank's advantages
    )
    step1 = step1_weights_callback()
    groups = []

    def recording_reward(prompts, completion_ids, **kwargs):
        groups.append(list(prompts))
        return length_reward(completion_ids)

    trainer = RLOOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=recording_reward,
        args=args,
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
        callbacks=[step1],
    )
    # RLOOTrainer takes no rollout_func argument; the shared online base calls this hook when it is set.
    trainer.rollout_func = fixed_rollout
    trainer.seen_rows = []
    step1.trainer = trainer
    trainer.train()
    extra = {"prompts": groups, **model_facts(trainer.ref_model, "ref")}
    write_report(out_dir, rank_report(trainer, trainer.seen_rows, step1, extra=extra))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_single(train_rloo, tmp_path_factory.mktemp("rloo_single"), per_device_batch=2 * PER_DEVICE_BATCH)


@pytest.mark.parametrize("engine", engine_params(["ddp", "zero3", "fsdp2"]))
def test_rloo_two_processes_match_one(engine, tmp_path, single):
    reports = launch(f"{__file__}:train_rloo", tmp_path, engine)
    assert_data_parallel_run(reports, engine)
    # one group per step: the same prompt on both ranks (the sampler keeps a group together across processes)
    for step in range(len(single["batches"])):
        prompts = {prompt for report in reports for prompt in report["prompts"][step]}
        assert len(prompts) == 1, f"step {step + 1}: the ranks got different prompts {prompts}"
        assert len(set(single["prompts"][step])) == 1
    assert_matches_single_process(reports, single, lr=COMPARISON_LR)
    assert_same_weights(load_weights(reports[0]), load_weights(single), atol=1e-4, what="final weights")
    assert_metrics_reduced(reports, single, GLOBAL_METRICS, tol=1e-5, per_process_names=PROCESS_MEAN_METRICS)
    # the policy moved away from the reference after the first step: the KL penalty was really exercised
    assert single["logs"][0]["kl"] == 0.0 and single["logs"][-1]["kl"] != 0.0
    assert_reference_prepared(reports, engine)

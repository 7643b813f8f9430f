"""GRPO with two CPU processes (gloo) under DDP, DeepSpeed ZeRO-2/ZeRO-3 and FSDP2.

Groups of `num_generations` completions span both ranks here (4 completions, 2 per rank), so rewards and advantages
must be gathered across processes. With fixed completions (a `rollout_func`), the losses, gradients, weights and
metrics must be those of one process on the whole global batch, with a KL reference model prepared like the policy.
Real generation is checked under ZeRO-3 with gathered and with layer-by-layer parameters
(`ds3_gather_for_generation`) and under FSDP2: greedy completions equal the single-process ones. Helpers:
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
GLOBAL_METRICS += ["reward", "reward_std", "frac_reward_zero_std"]
# Per-process token means averaged over the processes (as in TRL): equal on every rank, but with ranks holding
# different numbers of tokens not exactly the single-process token mean.
PROCESS_MEAN_METRICS = ["entropy", "kl", "clip_ratio/region_mean"]


def train_grpo(out_dir: str, per_device_batch: int = PER_DEVICE_BATCH, generate: bool = False, gather: bool = True):
    """Worker: a few plain-SGD GRPO steps on the tiny model; writes this rank's report to `out_dir`.

    With `generate=False` completions come from `fixed_rollout`; with `generate=True` the policy generates greedily
    (`top_k=1`) and the completions are recorded by the reward function.
    """
    from trl import GRPOConfig, GRPOTrainer
    from trl.assets import get_model_path, load_test_dataset

    args = comparison_args(
        GRPOConfig,
        out_dir,
        per_device_batch,
        num_generations=NUM_GENERATIONS,
        max_completion_length=6,
        beta=0.1,
        top_k=1 if generate else 0,
        ds3_gather_for_generation=gather,
    )
    step1 = step1_weights_callback()
    completions = []

    def recording_reward(prompts, completion_ids, **kwargs):
        completions.append([[prompt, ids] for prompt, ids in zip(prompts, completion_ids)])
        return length_reward(completion_ids)

    trainer = GRPOTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=recording_reward,
        args=args,
        train_dataset=load_test_dataset("standard_prompt_only", split="train"),
        callbacks=[step1],
        rollout_func=None if generate else fixed_rollout,
    )
    trainer.seen_rows = []
    step1.trainer = trainer
    trainer.train()
    extra = {"completions": completions, **model_facts(trainer.ref_model, "ref")}
    write_report(out_dir, rank_report(trainer, trainer.seen_rows or completions, step1, extra=extra))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_single(train_grpo, tmp_path_factory.mktemp("grpo_single"), per_device_batch=2 * PER_DEVICE_BATCH)


@pytest.fixture(scope="module")
def single_generating(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_single_generating")
    return run_single(train_grpo, out, per_device_batch=2 * PER_DEVICE_BATCH, generate=True)


@pytest.mark.parametrize("engine", engine_params())
def test_grpo_two_processes_match_one(engine, tmp_path, single):
    reports = launch(f"{__file__}:train_grpo", tmp_path, engine)
    assert_data_parallel_run(reports, engine)
    # one group per step: the same prompt on both ranks, and the ranks' rows together are the single run's group
    for step in range(len(single["batches"])):
        prompts = {prompt for report in reports for prompt, _ in report["completions"][step]}
        assert len(prompts) == 1
    assert_matches_single_process(reports, single, lr=COMPARISON_LR)
    assert_same_weights(load_weights(reports[0]), load_weights(single), atol=1e-4, what="final weights")
    assert_metrics_reduced(reports, single, GLOBAL_METRICS, tol=1e-5, per_process_names=PROCESS_MEAN_METRICS)
    assert_reference_prepared(reports, engine)


GENERATION_CASES = [
    pytest.param("zero3", True, marks=engine_params(["zero3"])[0].marks, id="zero3-gathered"),
    pytest.param("zero3", False, marks=engine_params(["zero3"])[0].marks, id="zero3-layer-by-layer"),
    pytest.param("fsdp2", True, id="fsdp2"),
]


@pytest.mark.parametrize(("engine", "gather"), GENERATION_CASES)
def test_grpo_generation_on_sharded_engines(engine, gather, tmp_path, single_generating):
    """Generation from sharded parameters gives the single-process (greedy) completions."""
    reports = launch(f"{__file__}:train_grpo", tmp_path, engine, generate=True, gather=gather)
    assert_data_parallel_run(reports, engine)
    steps = len(single_generating["completions"])
    assert steps == 3
    for step in range(steps):
        rows = sorted(row for report in reports for row in report["completions"][step])
        assert rows == sorted(single_generating["completions"][step])
        assert any(ids for _, ids in rows), "nothing was generated"
    for report in reports:
        assert [log["loss"] for log in report["logs"]] == pytest.approx(single_generating["losses"], abs=1e-5)

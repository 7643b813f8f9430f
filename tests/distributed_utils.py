"""Shared machinery of the multi-process tests (tests/test_distributed_*.py).

Three roles live here:

* the pytest side: [`launch`] starts a worker function in 2 CPU processes (gloo) through `accelerate launch` with
  one of the engines in [`ENGINES`] and returns what each rank reported;
* the launched script: running this file as `python tests/distributed_utils.py MODULE_PATH:FUNCTION OUT_DIR
  JSON_KWARGS` applies the CPU-only test patches below, imports the test module and calls the worker function;
* the worker side: [`rank_report`] collects, on every rank, the facts the tests assert (world size, engine, whether
  parameters are really sharded, full gathered weights, logged losses, which rows the rank trained on).

Test-only patches applied in launched workers (never in the library):

* accelerate ignores FSDP when the processes run on the CPU (`AcceleratorState` only switches to FSDP for GPU-like
  distributed types); the patch switches a MULTI_CPU state with an FSDP plugin to FSDP, so torch `fully_shard` runs
  on gloo;
* DeepSpeed JIT-compiles a shared-memory all-reduce kernel the first time its communication backend starts on a CPU
  (minutes on a small machine); it is marked unavailable so DeepSpeed uses plain gloo collectives, which is what is
  being tested. Set `TRL_TEST_DEEPSPEED_SHM=1` to keep the kernel.
"""

import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


TESTS_DIR = Path(__file__).resolve().parent
CONFIG_DIR = TESTS_DIR / "fixtures" / "accelerate_configs"

# engine -> accelerate config file (None: trl's CPU route, `--num_processes 2` rewritten to a gloo torchrun launch)
ENGINES: dict[str, str | None] = {
    "ddp": None,
    "zero2": "zero2_cpu.yaml",
    "zero3": "zero3_cpu.yaml",
    "fsdp2": "fsdp2_cpu.yaml",
}

COMPARISON_LR = 0.1

# What `accelerator.distributed_type` must be in the workers for each engine.
EXPECTED_DISTRIBUTED_TYPE = {
    "ddp": "MULTI_CPU",
    "zero2": "DEEPSPEED",
    "zero3": "DEEPSPEED",
    "fsdp2": "FSDP",
}


# ----------------------------------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------------------------------
def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def needs_engine(engine: str) -> list:
    """pytest marks for a test using `engine`: DeepSpeed engines are skipped when DeepSpeed is not installed."""
    import pytest

    if engine.startswith("zero"):
        reason = "DeepSpeed is not installed (`make test-distributed` installs it)"
        return [pytest.mark.skipif(not deepspeed_available(), reason=reason)]
    return []


def engine_params(engines=tuple(ENGINES)) -> list:
    """`pytest.param`s for parametrising a test over engines, with the DeepSpeed skip where it applies."""
    import pytest

    return [pytest.param(engine, marks=needs_engine(engine), id=engine) for engine in engines]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    worker: str,
    out_dir: "str | os.PathLike",
    engine: str = "ddp",
    num_processes: int = 2,
    timeout: int = 600,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Run `worker` (`"path/to/module.py:function"`) in `num_processes` CPU processes and return each rank's report.

    The worker is called as `function(out_dir, **kwargs)` in every process and must write its report with
    [`write_report`]. The launch goes through trl's own launcher (`trl.cli.accelerate_launcher`), so DDP uses the
    same CPU rewrite as `trl <command> --num_processes 2`; the other engines pass their CPU config file. A fresh
    port is used so that concurrent test runs on one machine do not collide.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    launch_args = ["--num_processes", str(num_processes), "--main_process_port", str(_free_port())]
    config = ENGINES[engine]
    if config is not None:
        launch_args = ["--config_file", str(CONFIG_DIR / config), *launch_args]
    script_args = [worker, str(out_dir), json.dumps(kwargs)]
    code = (
        "from trl.cli.accelerate_launcher import launch_training_script\n"
        f"launch_training_script({__file__!r}, {launch_args!r}, {script_args!r})\n"
    )
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    # A session of its own, so that a timeout ends the launcher and all its workers, not just the launcher.
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(out_dir),
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as error:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        (out_dir / "launch.log").write_text(f"{stdout}\n----- stderr -----\n{stderr}")
        message = f"distributed run ({engine}, {worker}) timed out after {timeout} s:\n{stderr[-6000:]}"
        raise AssertionError(message) from error
    (out_dir / "launch.log").write_text(f"{stdout}\n----- stderr -----\n{stderr}")
    if process.returncode != 0:
        raise AssertionError(
            f"distributed run ({engine}, {worker}) failed with exit code {process.returncode}:\n"
            f"{stdout[-3000:]}\n{stderr[-6000:]}"
        )
    reports = []
    for rank in range(num_processes):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            raise AssertionError(
                f"rank {rank} wrote no report: the launch did not start {num_processes} processes.\n{stderr[-4000:]}"
            )
        reports.append(json.loads(path.read_text()))
    return reports


def load_weights(report: dict[str, Any], name: str = "final") -> dict[str, Any]:
    """Full weights that rank 0 (or the single-process run) saved under `name` (a report key `"_<name>"`)."""
    import torch

    return torch.load(report["weights"][name], weights_only=True)


def assert_same_weights(a: dict, b: dict, atol: float, what: str = "weights") -> None:
    assert a.keys() == b.keys(), f"{what}: different parameter names"
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, f"{what} differ by {worst:.3g} (> {atol:g})"


def assert_data_parallel_run(reports: list[dict[str, Any]], engine: str, num_processes: int = 2) -> None:
    """The facts every multi-process run must show: N ranks of one job, on the expected engine, one model."""
    assert [r["world_size"] for r in reports] == [num_processes] * num_processes, "not one job of N processes"
    assert [r["process_index"] for r in reports] == list(range(num_processes))
    assert {r["distributed_type"] for r in reports} == {EXPECTED_DISTRIBUTED_TYPE[engine]}
    assert {r["device"] for r in reports} == {"cpu"}
    if engine == "zero2":
        assert {r["zero_stage"] for r in reports} == {2}
    if engine == "zero3":
        assert {r["zero_stage"] for r in reports} == {3}
    if engine == "fsdp2":
        assert {r["fsdp_version"] for r in reports} == {2}
    if engine in ("zero3", "fsdp2"):
        # real partitioning: each rank holds only part of the parameters
        for report in reports:
            assert 0 < report["local_numel"] < report["full_numel"], report
    else:
        assert {r["local_numel"] for r in reports} == {reports[0]["full_numel"]}
    digests = {r["weights_digest"] for r in reports}
    assert len(digests) == 1, "the ranks ended with different weights: they did not train one model"


def assert_matches_single_process(
    reports: list[dict[str, Any]], single: dict[str, Any], lr: float, tol: float = 1e-5
) -> None:
    """Two processes x batch B behave like one process x batch 2B: same losses, same gradients, same weights.

    The runs use plain SGD, so the first update is `-lr * gradient`: comparing the weights after step 1 compares the
    (all-reduced) gradients.
    """
    for report in reports:
        assert len(report["losses"]) == len(single["losses"])
        for step, (got, want) in enumerate(zip(report["losses"], single["losses"]), start=1):
            assert abs(got - want) <= tol * max(1.0, abs(want)), f"step {step}: loss {got} != single-process {want}"
        # Engines compute the norm differently (torch's float32 norm of this model is itself 2e-5 off the exact
        # one), so the logged norm gets a looser check; the gradients themselves are compared below at `tol`.
        for step, (got, want) in enumerate(zip(report["grad_norms"], single["grad_norms"]), start=1):
            assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), f"step {step}: grad norm {got} != {want}"
    # The rows of one global batch are split between the ranks: disjoint, and together the single run's batch.
    steps = len(single["batches"])
    for step in range(steps):
        per_rank = [report["batches"][step] for report in reports]
        assert len({len(rows) for rows in per_rank}) == 1, "the ranks got batches of different sizes"
        assert per_rank[0] != per_rank[1], f"step {step + 1}: both ranks trained on the same rows"
        # As multisets (the data may repeat a text): the ranks' rows together are exactly the single run's batch.
        union = sorted(row for rows in per_rank for row in rows)
        assert union == sorted(single["batches"][step]), f"step {step + 1}: the ranks did not share the global batch"
    gradient_step1 = load_weights(reports[0], "step1")
    assert_same_weights(gradient_step1, load_weights(single, "step1"), atol=tol * lr, what="step-1 update (gradient)")


def assert_metrics_reduced(
    reports: list[dict[str, Any]],
    single: dict[str, Any],
    names: list[str],
    tol: float,
    per_process_names: tuple[str, ...] = (),
) -> None:
    """Metrics are reduced over the ranks before logging: at every step equal on both ranks, and the `names` equal
    (within `tol`) to the single run's. `per_process_names` (per-process means averaged over the ranks) are only
    required to be equal on both ranks."""
    for step, rank_logs in enumerate(zip(reports[0]["logs"], reports[1]["logs"], single["logs"]), start=1):
        for name in [*names, *per_process_names]:
            values = [logs[name] for logs in rank_logs]
            assert values[0] == values[1], f"step {step}: {name} differs between the ranks"
            if name in names:
                close = abs(values[0] - values[2]) <= max(tol, 1e-6 * abs(values[2]))  # as pytest.approx(abs=tol)
                assert close, f"step {step}: {name} {values[0]} != single-process {values[2]}"


def assert_reference_prepared(reports: list[dict[str, Any]], engine: str) -> None:
    """The reference model (reported by [`model_facts`] with prefix `ref`) stays frozen in eval mode and is prepared
    like the policy: a ZeRO-3 inference engine or FSDP2 shards on the sharding engines, whole elsewhere."""
    for report in reports:
        assert report["ref_training"] is False
        if engine == "zero3":
            assert report["ref_wrapper"] == "DeepSpeedEngine"
            assert 0 < report["ref_local_numel"] < report["ref_full_numel"]
        elif engine == "fsdp2":
            assert report["ref_wrapper"].startswith("FSDP")
            assert 0 < report["ref_local_numel"] < report["ref_full_numel"]
        else:
            assert report["ref_local_numel"] == report["ref_full_numel"]


# ----------------------------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------------------------
def _engine_facts(trainer) -> dict[str, Any]:
    accelerator = trainer.accelerator
    state = accelerator.state
    plugin = getattr(state, "deepspeed_plugin", None)
    fsdp_plugin = getattr(state, "fsdp_plugin", None)
    return {
        "world_size": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "device": accelerator.device.type,
        "zero_stage": getattr(plugin, "zero_stage", None) if plugin is not None else None,
        "fsdp_version": getattr(fsdp_plugin, "fsdp_version", None) if fsdp_plugin is not None else None,
    }


def local_numel(model) -> int:
    """Number of parameter elements this rank actually holds (ZeRO-3 and FSDP2 hold one shard)."""
    total = 0
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):  # ZeRO-3: the local partition
            total += param.ds_tensor.numel()
        elif hasattr(param, "to_local"):  # FSDP2: a DTensor sharded over the ranks
            total += param.to_local().numel()
        else:
            total += param.numel()
    return total


def full_numel(model) -> int:
    return sum(getattr(param, "ds_numel", None) or param.numel() for param in model.parameters())


def gathered_parameters(model) -> dict[str, Any]:
    """Full (gathered) float32 parameters of `model` on every rank, whatever shards them (ZeRO-3, FSDP2 or nothing).

    A collective under ZeRO-3 and FSDP2: every rank must call it.
    """
    params = dict(getattr(model, "module", model).named_parameters())
    if any(hasattr(p, "ds_tensor") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().float().clone() for name, p in params.items()}
    out = {}
    for name, param in params.items():
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[name] = tensor.float().cpu().clone()
    return out


def full_state(trainer) -> dict[str, Any]:
    """Full parameters of the trained model (see [`gathered_parameters`])."""
    return gathered_parameters(trainer.accelerator.unwrap_model(trainer.model_wrapped))


def digest(state: dict[str, Any]) -> str:
    sha = hashlib.sha256()
    for name in sorted(state):
        sha.update(name.encode())
        sha.update(state[name].numpy().tobytes())
    return sha.hexdigest()


def step1_weights_callback():
    """A TrainerCallback that keeps the full weights right after the first optimizer step (in `.state`)."""
    from transformers import TrainerCallback

    class _Step1(TrainerCallback):
        def __init__(self):
            self.trainer = None
            self.state = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.state = full_state(self.trainer)

    return _Step1()


def recording(trainer_class):
    """Subclass of `trainer_class` that records, in `seen_rows`, the unpadded rows of every training batch."""

    class Recording(trainer_class):
        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                if not hasattr(self, "seen_rows"):
                    self.seen_rows = []
                ids, mask = inputs["input_ids"], inputs.get("attention_mask")
                if mask is None:
                    self.seen_rows.append([row.tolist() for row in ids])
                else:
                    self.seen_rows.append([row[m.bool()].tolist() for row, m in zip(ids, mask)])
            return super().compute_loss(model, inputs, *args, **kwargs)

    Recording.__name__ = trainer_class.__name__
    return Recording


@contextlib.contextmanager
def record_saves():
    """Inside the block, record (in the yielded list) every model weights / model card write of this process."""
    from huggingface_hub import RepoCard
    from transformers import PreTrainedModel

    events: list[str] = []
    save_pretrained, save_card = PreTrainedModel.save_pretrained, RepoCard.save

    def recorded_save_pretrained(self, *args, **kwargs):
        events.append("weights")
        return save_pretrained(self, *args, **kwargs)

    def recorded_save_card(self, *args, **kwargs):
        events.append("model_card")
        return save_card(self, *args, **kwargs)

    PreTrainedModel.save_pretrained = recorded_save_pretrained
    RepoCard.save = recorded_save_card
    try:
        yield events
    finally:
        PreTrainedModel.save_pretrained, RepoCard.save = save_pretrained, save_card


def comparison_args(config_class, out_dir: str, per_device_batch: int, **overrides: Any):
    """Training arguments of the 1-process vs 2-process comparisons (plain SGD, no clipping, log every step)."""
    values = dict(
        output_dir=out_dir,
        use_cpu=True,  # without it each worker would train its own copy (see docs/distributing_training.md)
        bf16=False,  # with use_cpu, bf16=None means CPU bf16 autocast (as in TRL): the comparisons are in fp32
        max_steps=3,
        per_device_train_batch_size=per_device_batch,
        optim="sgd",  # the first update is then -lr * gradient: comparing weights compares gradients
        learning_rate=COMPARISON_LR,
        lr_scheduler_type="constant",
        max_grad_norm=1e9,  # logged, never clipped: a wrongly scaled gradient must show
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    values.update(overrides)
    return config_class(**values)


def model_facts(model, prefix: str) -> dict[str, Any]:
    """Type and sharding of an auxiliary model (reference, reward) as the trainer prepared it."""
    inner = getattr(model, "module", model)
    return {
        f"{prefix}_wrapper": type(model).__name__,
        f"{prefix}_local_numel": local_numel(inner),
        f"{prefix}_full_numel": full_numel(inner),
        f"{prefix}_training": bool(inner.training),  # a DeepSpeed engine keeps its own flag; its module counts
    }


# Online trainers (GRPO, RLOO): completions and rewards that do not depend on how the batch is split over processes.
def fixed_rollout(prompts, trainer):
    """Completions that depend only on the prompt and the row's global index: 1 to 4 tokens taken from the prompt.

    The global index (process offset + row) is the same whether one process generates the whole round or each rank
    its share, so every run trains on exactly the same completions. A `rollout_func` (called as `rollout_func(prompts, trainer)`);
    the rows (prompt + completion ids) are appended to `trainer.seen_rows`, which the worker sets to `[]`.
    """
    tokenizer = trainer.processing_class
    offset = trainer.accelerator.process_index * len(prompts)
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    completion_ids = []
    for row, ids in enumerate(prompt_ids):
        index = offset + row
        completion_ids.append([ids[(index + j) % len(ids)] for j in range(1 + index % 4)])
    trainer.seen_rows.append([p + c for p, c in zip(prompt_ids, completion_ids)])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids}


def length_reward(completion_ids, **kwargs):
    """Reward = completion length in tokens (distinct within every group of `fixed_rollout`)."""
    return [float(len(ids)) for ids in completion_ids]


def run_single(worker, out_dir: "str | os.PathLike", **kwargs: Any) -> dict[str, Any]:
    """Run a worker function in this (non-distributed) process and return its report."""
    worker(str(out_dir), **kwargs)
    return json.loads((Path(out_dir) / "rank0.json").read_text())


def rank_report(trainer, batches: list, step1: Any = None, extra: dict | None = None) -> dict[str, Any]:
    """Facts about a finished run on this rank (see module docstring). `batches`: rows seen at each train step."""
    final = full_state(trainer)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    report = {
        **_engine_facts(trainer),
        "local_numel": local_numel(model),
        "full_numel": full_numel(model),
        "weights_digest": digest(final),
        "losses": [entry["loss"] for entry in logs],
        "grad_norms": [float(entry["grad_norm"]) for entry in logs if "grad_norm" in entry],
        "logs": logs,
        "batches": batches,
        "_final": final,
        "_step1": step1.state if step1 is not None else None,
    }
    report.update(extra or {})
    return report


def write_report(out_dir: str, report: dict[str, Any]) -> None:
    """Write a rank's report (JSON) and, from rank 0 only, its weights (torch files) to `out_dir`."""
    import torch

    out = Path(out_dir)
    rank = report["process_index"]
    weights = {}
    for key in [key for key in report if key.startswith("_")]:  # "_name": full weights, saved as a torch file
        state = report.pop(key)
        if state is not None and rank == 0:
            path = out / f"weights{key}.pt"
            torch.save(state, path)
            weights[key[1:]] = str(path)
    report["weights"] = weights
    (out / f"rank{rank}.json").write_text(json.dumps(report))


# ----------------------------------------------------------------------------------------------------------------
# Launched script
# ----------------------------------------------------------------------------------------------------------------
def _allow_fsdp_on_cpu() -> None:
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_trl_test_patch", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # Every `AcceleratorState()` copies the process state (MULTI_CPU) over its own again: re-apply each time.
        plugin = kwargs.get("fsdp_plugin") or getattr(self, "fsdp_plugin", None)
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    __init__._trl_test_patch = True
    AcceleratorState.__init__ = __init__


def _skip_deepspeed_shm_kernel() -> None:
    if os.environ.get("TRL_TEST_DEEPSPEED_SHM") == "1" or not deepspeed_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _main(argv: list[str]) -> None:
    target, out_dir, kwargs = argv[1], argv[2], json.loads(argv[3]) if len(argv) > 3 else {}
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        _allow_fsdp_on_cpu()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        _skip_deepspeed_shm_kernel()
    path, function = target.rsplit(":", 1)
    sys.path.insert(0, str(TESTS_DIR))
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, function)(out_dir, **kwargs)
    from trl.scripts._training import release_process_group

    release_process_group()


if __name__ == "__main__":
    _main(sys.argv)

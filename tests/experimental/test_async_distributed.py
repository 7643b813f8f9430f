"""AsyncGRPO and AsyncDistillation on two CPU processes (gloo, DDP).

Rank 0 alone holds the in-process generation backend, the weight transfer and the rollout worker (as it alone holds
the server connection in production); it reads the rollout queue and dispatches one packed row to each rank, rank 1
only trains on the row it receives. Checked: training ends on both ranks within a bounded time with one model (equal
parameters, changed by training); `token_budget=None` takes rank 0's server budget on every rank; the loss of the
first micro-batch equals a hand computation from the two dispatched rows (each rank's sum divided by the micro-batch's
trained tokens per rank, `global_n_tokens / world_size`); rank 0 logs TRL's metric keys; `rollout_state.json` is
written once; a failure on rank 0 (a backend that cannot start, a worker that dies mid-training, an unreachable
server at construction) stops both ranks with its error. Helpers: tests/distributed_utils.py.
"""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from distributed_utils import digest, full_state, launch, write_report


pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the launched workers import test_async_grpo's backend and transfer
    sys.path.insert(0, str(HERE))
TINY = "tiny-Qwen2ForCausalLM"
SERVER_MAX_MODEL_LEN = 160  # the budget `token_budget=None` asks of the server: two groups of 4 samples per row
LAUNCH_TIMEOUT = 420  # a hang fails the test after this many seconds (a 2-step run takes well under a minute)
GRPO_KEYS = {
    "loss", "ratio", "kl", "entropy", "clip_ratio/region_mean", "reward", "reward_std", "rewards/index_reward",
    "sample/staleness_mean", "sample/rollout_queue_size", "batch/packing_ratio", "batch/pad_frac",
    "batch/row_imbalance", "batch/samples_per_step", "batch/groups_per_step", "batch/trained_tokens_per_step",
    "perf/step_s", "perf/fwd_bwd_s", "perf/rollout_wait_s", "perf/weight_sync_s", "rollout/duration_s",
    "completions/mean_length",
}  # fmt: skip
DISTILLATION_KEYS = {
    "loss", "jsd", "entropy", "teacher_entropy", "rollout/score_s", "sample/staleness_mean", "batch/pad_frac",
    "batch/row_imbalance", "batch/trained_tokens_per_step", "perf/step_s", "perf/weight_sync_s",
}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Worker side (run in each of the two processes)
# ----------------------------------------------------------------------------------------------------------------
def _rank() -> int:
    """This worker's rank, from the launcher (before a training config exists, `PartialState()` may resolve to a
    single process: the config sets the distributed state up)."""
    return int(os.environ.get("RANK", "0"))


def index_reward(completion_ids, **kwargs):
    """Distinct rewards within every group, so that every step has non-zero advantages (and a gradient)."""
    return [float(index) for index in range(len(completion_ids))]


def _backend(**kwargs):
    """test_async_grpo's in-process backend, reporting a server `max_model_len` (what `token_budget=None` asks)."""
    from test_async_grpo import LocalBackend

    from trl.assets import get_model_path

    class ServerBackend(LocalBackend):
        def get_max_model_len(self):
            return SERVER_MAX_MODEL_LEN

    return ServerBackend(get_model_path(TINY), **kwargs)


def _recording(trainer_class, backend):
    """`trainer_class` generating with `backend` (rank 0) and recording each micro-batch and its loss."""

    class Recording(trainer_class):
        _poll_interval_s = 0.2
        recorded: list

        def _build_generation_backend(self):
            return backend

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            jsd = self._metrics["jsd"][-1] if "jsd" in self._metrics else None
            batch = {key: value.detach().cpu() for key, value in inputs.items()}
            self.recorded.append({"inputs": batch, "loss": float(loss), "jsd": jsd})
            return loss

    return Recording


class _CountRolloutStateWrites:
    """Stands in for the trainer module's `json` while training, counting the writes of `rollout_state.json`."""

    def __init__(self):
        self.count = 0

    def __getattr__(self, name):
        return getattr(json, name)

    def dump(self, obj, handle, *args, **kwargs):
        if str(getattr(handle, "name", "")).endswith("rollout_state.json"):
            self.count += 1
        return json.dump(obj, handle, *args, **kwargs)


def _train_and_report(trainer, out_dir: str) -> None:
    """Train, then write this rank's report: weights digests, logs, the first micro-batch, rollout_state writes."""
    import trl.experimental.async_grpo.async_grpo_trainer as module

    trainer.recorded = []
    before = digest(full_state(trainer))
    counter = _CountRolloutStateWrites()
    module.json = counter
    try:
        trainer.train()
    finally:
        module.json = json
    rank = trainer.accelerator.process_index
    first = trainer.recorded[0]
    torch.save(first["inputs"], Path(out_dir) / f"rank{rank}_batch1.pt")
    transfer = trainer.weight_transfer
    report = {
        "process_index": rank,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
        "digest_before": before,
        "digest_after": digest(full_state(trainer)),
        "global_step": trainer.state.global_step,
        "model_version": trainer.model_version,
        "token_budget": trainer._token_budget,
        "collator_token_budget": trainer.data_collator.token_budget,
        "has_worker": trainer.rollout_worker is not None,
        "transfer_events": [str(event) for event in transfer.events] if transfer is not None else None,
        "first_loss": first["loss"],
        "first_jsd": first["jsd"],
        "logs": [entry for entry in trainer.state.log_history if "loss" in entry],
        "rollout_state_writes": counter.count,
    }
    write_report(out_dir, report)


def train_async_grpo(out_dir: str, token_budget: int | None = None, one_epoch: bool = False) -> None:
    """Worker: 2 AsyncGRPO steps (or, with `one_epoch`, until the 6 prompts were trained once, 2 groups per step),
    the backend and the weight transfer on rank 0 only."""
    from datasets import Dataset
    from test_async_grpo import PROMPT, LocalTransfer

    from trl.assets import get_model_path
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    rank0 = _rank() == 0
    backend = _backend() if rank0 else None
    length = (
        {"max_steps": -1, "num_train_epochs": 1, "save_steps": 1000}
        if one_epoch
        else {"max_steps": 2, "save_steps": 2}
    )
    args = AsyncGRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, per_device_train_batch_size=4 if one_epoch else 2,
        num_generations=4, max_completion_length=4, token_budget=token_budget, learning_rate=0.05,
        report_to="none", save_strategy="steps", heartbeat_stale_after_s=120.0, disable_tqdm=True, seed=0, **length,
    )  # fmt: skip
    # Rank 1 is handed nothing, or (budget from the server) a transfer it must ignore: it has no backend to fill.
    other_transfer = LocalTransfer(None) if token_budget is None else None
    trainer = _recording(AsyncGRPOTrainer, backend)(
        get_model_path(TINY),
        reward_funcs=index_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 6}),
        weight_transfer=LocalTransfer(backend) if rank0 else other_transfer,
    )
    _train_and_report(trainer, out_dir)


def _caught(fn) -> str | None:
    try:
        fn()
    except Exception as error:
        return f"{error!r} (caused by {error.__cause__!r})"
    return None


def fail_async_grpo(out_dir: str) -> None:
    """Worker: three failures of rank 0 in a row, each of which must reach both ranks; reports each rank's errors."""
    from datasets import Dataset
    from test_async_grpo import PROMPT, LocalTransfer

    from trl.assets import get_model_path
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    rank0 = _rank() == 0
    dataset = Dataset.from_dict({"prompt": [PROMPT] * 6})
    config = {
        "output_dir": out_dir, "use_cpu": True, "bf16": False, "max_steps": 50, "per_device_train_batch_size": 8,
        "num_generations": 4, "max_completion_length": 4, "token_budget": 256, "report_to": "none",
        "save_strategy": "no", "heartbeat_stale_after_s": 120.0, "disable_tqdm": True,
    }  # fmt: skip

    def train_with(backend):
        trainer = _recording(AsyncGRPOTrainer, backend)(
            get_model_path(TINY), reward_funcs=index_reward, args=AsyncGRPOConfig(**config), train_dataset=dataset,
            weight_transfer=LocalTransfer(backend) if rank0 else None,
        )  # fmt: skip
        trainer.recorded = []
        trainer.train()

    def unreachable_server():
        args = AsyncGRPOConfig(**{**config, "vllm_server_base_url": "http://127.0.0.1:9", "vllm_server_timeout": 0.5})
        AsyncGRPOTrainer(get_model_path(TINY), reward_funcs=index_reward, args=args, train_dataset=dataset)

    errors = {
        "start": _caught(lambda: train_with(_backend(unreachable=True) if rank0 else None)),
        "worker": _caught(lambda: train_with(_backend(fail_after=1) if rank0 else None)),
        "construction": _caught(unreachable_server),
    }
    write_report(out_dir, {"process_index": _rank(), "errors": errors})


def train_async_distillation(out_dir: str, max_steps: int = 2) -> None:
    """Worker: `max_steps` AsyncDistillation steps; rank 0 serves a stub teacher (test_async_distillation's)."""
    import threading
    from http.server import ThreadingHTTPServer

    from datasets import Dataset
    from test_async_grpo import LocalTransfer
    from test_vllm_client_openai_scoring import _OpenAIStub
    from transformers import AutoModelForCausalLM

    from trl.assets import get_model_path
    from trl.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer

    rank0 = _rank() == 0
    teacher_url, server = "http://127.0.0.1:9", None  # rank 1 never talks to the teacher
    if rank0:
        _OpenAIStub.model = AutoModelForCausalLM.from_pretrained(get_model_path("small-Qwen2ForCausalLM")).eval()
        _OpenAIStub.requests = []
        server = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIStub)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        teacher_url = f"http://127.0.0.1:{server.server_address[1]}"
    backend = _backend() if rank0 else None
    args = AsyncDistillationConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, max_steps=max_steps, per_device_train_batch_size=2,
        max_completion_length=4, token_budget=None, learning_rate=0.05, report_to="none", save_strategy="steps",
        save_steps=max_steps, teacher_server_urls={"default": teacher_url}, teacher_top_k=3,
        heartbeat_stale_after_s=120.0, disable_tqdm=True, seed=0,
    )  # fmt: skip
    prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(6)]
    trainer = _recording(AsyncDistillationTrainer, backend)(
        get_model_path(TINY),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        weight_transfer=LocalTransfer(backend) if rank0 else None,
    )
    try:
        _train_and_report(trainer, out_dir)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


# ----------------------------------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------------------------------
def _launch(worker: str, out_dir: Path, **kwargs) -> list[dict]:
    return launch(f"{__file__}:{worker}", out_dir, timeout=LAUNCH_TIMEOUT, **kwargs)


def _assert_one_model_trained(reports: list[dict], steps: int) -> None:
    assert [r["world_size"] for r in reports] == [2, 2] and {r["distributed_type"] for r in reports} == {"MULTI_CPU"}
    assert [r["global_step"] for r in reports] == [steps, steps]
    assert reports[0]["digest_before"] == reports[1]["digest_before"]
    assert reports[0]["digest_after"] == reports[1]["digest_after"], "the ranks ended with different parameters"
    assert reports[0]["digest_after"] != reports[0]["digest_before"], "training did not change the parameters"
    # Rank 0 alone ran the worker and pushed weights: the initial sync and one per step; rank 1 holds neither.
    assert [r["has_worker"] for r in reports] == [True, False] and reports[1]["transfer_events"] is None
    events = reports[0]["transfer_events"]
    assert events[0] == "init" and events[-1] == "destroy"
    assert sum(event.startswith("('send'") for event in events) == steps + 1
    assert {r["model_version"] for r in reports} == {steps + 1}
    # Both ranks log the same (rank-averaged) loss.
    assert [log["loss"] for log in reports[0]["logs"]] == [log["loss"] for log in reports[1]["logs"]]
    # The checkpoint's rollout_state.json: written once, by rank 0.
    assert [r["rollout_state_writes"] for r in reports] == [1, 0]


def _tree_token_loss_sum(model, batch: dict, epsilon: float) -> tuple[float, int]:
    """By hand, on one dispatched row: the sum over its trained tokens of the clipped surrogate, and their count."""
    length = int(batch["attention_mask"][0].sum())
    token_index = batch["token_index"][0]
    token_index = token_index[token_index >= 0]
    cu_q, cu_k, kv_index = batch["tree_cu_seqlens_q"][0], batch["tree_cu_seqlens_k"][0], batch["tree_kv_index"][0]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"][:, :length], position_ids=batch["position_ids"][:, :length],
            tree_kv_index=kv_index[kv_index >= 0], tree_cu_seqlens_q=cu_q[cu_q >= 0].int(),
            tree_cu_seqlens_k=cu_k[cu_k >= 0].int(), tree_max_seqlen_q=int(batch["tree_max_seqlens"][0, 0]),
            tree_max_seqlen_k=int(batch["tree_max_seqlens"][0, 1]), use_cache=False,
        ).logits[0]  # fmt: skip
    total = 0.0
    labels = batch["shift_labels"][0]
    advantages = batch["advantages"][0].tolist()
    old = batch["old_log_probs"][0].tolist()
    for k, position in enumerate(token_index.tolist()):
        log_prob = float(torch.log_softmax(logits[position].double(), -1)[labels[position]])
        ratio = math.exp(log_prob - old[k])
        total -= min(ratio * advantages[k], min(max(ratio, 1 - epsilon), 1 + epsilon) * advantages[k])
    return total, len(token_index)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize(
    "token_budget, one_epoch",
    [(None, False), (80, False), (0, True)],
    ids=["budget-from-server", "fixed-budget", "fixed-count-one-epoch"],
)
def test_async_grpo_on_two_ranks(tmp_path, token_budget, one_epoch):
    from trl.assets import get_model_path
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention
    from trl.models.loading import create_model_from_path

    reports = _launch("train_async_grpo", tmp_path, token_budget=token_budget, one_epoch=one_epoch)
    steps = reports[0]["global_step"]
    # One epoch of 6 prompts at 2 groups per step: both ranks stop once rank 0 collated 6 distinct groups (it
    # collates one micro-batch ahead), far below the `max_steps` ceiling.
    assert 2 <= steps <= 3 if one_epoch else steps == 2
    _assert_one_model_trained(reports, steps=steps)
    # token_budget=None: the server's budget, asked on rank 0, is every rank's.
    expected_budget = SERVER_MAX_MODEL_LEN if token_budget is None else token_budget
    assert [(r["token_budget"], r["collator_token_budget"]) for r in reports] == [(expected_budget,) * 2] * 2
    state = json.loads((tmp_path / f"checkpoint-{steps}" / "rollout_state.json").read_text())
    assert state["model_version"] == steps + 1 and state["prompt_index"] >= 1
    logged = {key for log in reports[0]["logs"] for key in log if log[key] is not None}
    assert GRPO_KEYS <= logged, GRPO_KEYS - logged
    if token_budget:
        assert "batch/row_fill_frac" in logged

    # The first micro-batch, by hand: one row per rank; each rank divides its sum by global_n_tokens / 2, so the
    # logged (rank-averaged) loss is the sum over both rows divided by the micro-batch's trained tokens.
    register_tree_attention()
    model = create_model_from_path(get_model_path(TINY), device_map=None, attn_implementation=TREE_ATTENTION)
    model.eval()
    batches = [torch.load(tmp_path / f"rank{rank}_batch1.pt", weights_only=True) for rank in (0, 1)]
    sums, counts = zip(*(_tree_token_loss_sum(model, batch, epsilon=0.2) for batch in batches))
    global_n_tokens = {float(value) for batch in batches for value in batch["global_n_tokens"]}
    assert global_n_tokens == {float(sum(counts))} and min(counts) > 0
    for report, row_sum in zip(reports, sums):
        assert report["first_loss"] == pytest.approx(row_sum / (sum(counts) / 2), abs=1e-5)
    assert reports[0]["logs"][0]["loss"] == pytest.approx(sum(sums) / sum(counts), abs=1e-5)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_async_grpo_rank0_failures_stop_both_ranks(tmp_path):
    reports = _launch("fail_async_grpo", tmp_path)
    rank0, rank1 = (report["errors"] for report in reports)
    # The backend's readiness check fails on rank 0 when the worker starts: the same error on both ranks.
    for errors in (rank0, rank1):
        assert "failed to start" in errors["start"] and "ConnectionError" in errors["start"]
    # The worker dies mid-training: rank 0 raises its own error, rank 1 one carrying its message.
    assert "rollout worker failed" in rank0["worker"] and "backend exploded" in rank0["worker"]
    assert "Training stopped on rank 0" in rank1["worker"] and "backend exploded" in rank1["worker"]
    # An unreachable server at construction: rank 0's ConnectionError, raised on both ranks.
    for errors in (rank0, rank1):
        assert errors["construction"] is not None and "vLLM server can't be reached" in errors["construction"]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_async_distillation_on_two_ranks(tmp_path):
    reports = _launch("train_async_distillation", tmp_path)
    _assert_one_model_trained(reports, steps=2)
    assert [r["token_budget"] for r in reports] == [SERVER_MAX_MODEL_LEN] * 2
    assert (tmp_path / "checkpoint-2" / "rollout_state.json").is_file()
    logged = {key for log in reports[0]["logs"] for key in log if log[key] is not None}
    assert DISTILLATION_KEYS <= logged, DISTILLATION_KEYS - logged
    # Per rank, the loss is the sum of its positions' divergences (`jsd` is their mean) divided by
    # global_n_tokens / 2, global_n_tokens counting the completion tokens of both rows.
    batches = [torch.load(tmp_path / f"rank{rank}_batch1.pt", weights_only=True) for rank in (0, 1)]
    completion_tokens = sum(int(batch["completion_mask"][0].sum()) for batch in batches)
    assert {float(v) for batch in batches for v in batch["global_n_tokens"]} == {float(completion_tokens)}
    for report, batch in zip(reports, batches):
        length = int(batch["attention_mask"][0].sum())
        ids, lps = batch["teacher_topk_ids"][0, 1:length], batch["teacher_topk_logprobs"][0, 1:length]
        used = batch["completion_mask"][0, 1:length].bool() & ((ids >= 0) & torch.isfinite(lps)).any(-1)
        assert int(used.sum()) > 0
        expected = report["first_jsd"] * int(used.sum()) / (completion_tokens / 2)
        assert report["first_loss"] == pytest.approx(expected, rel=1e-5)

"""Unit tests of AsyncGRPO's pure pieces: prefix-tree packing and its attention, staleness dropping, planning,
collation, metric reduction, turn reconciliation, the loss and LoRA adapter export."""

import json
import math
import os
import queue
from collections import defaultdict

import numpy as np
import pytest
import torch

from trl.experimental.async_grpo import AsyncGRPOConfig
from trl.experimental.async_grpo.async_grpo_trainer import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    StepIntervalCallback,
    TokenBudgetBatcher,
    _iter_vllm_named_params,
    _reduce_metric,
    clipped_surrogate_loss,
    round_lora_rank,
    save_lora_adapter,
)
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample, TurnRecord, _chain_to_sequences
from trl.experimental.async_grpo.packing import TreeRow, tree_attention


def sample(ids, mask, group=0, advantage=1.0):
    return {
        "input_ids": np.array(ids),
        "completion_mask": np.array(mask),
        "old_log_probs": -0.1 * np.arange(len(ids), dtype=np.float32),
        "advantage": advantage,
        "group_id": group,
        "metrics": {"reward": float(group)},
    }


def test_config_defaults_and_batch_dispatch(tmp_path):
    args = AsyncGRPOConfig(str(tmp_path), use_cpu=True)
    assert (args.learning_rate, args.max_staleness, args.num_generations, args.token_budget) == (1e-6, 4, 8, None)
    assert args.accelerator_config.split_batches and args.accelerator_config.dispatch_batches


def test_tree_row_shares_prefixes_and_labels_trained_tokens():
    row = TreeRow()
    row.add(sample([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]))
    row.add(sample([1, 2, 3, 7, 8, 9], [0, 0, 1, 1, 1, 1], advantage=-1.0))
    row.add(sample([1, 2, 6], [0, 0, 1], advantage=0.5))
    assert row.load == 15 + 18 + 5 and row.trained == 8
    packed = row.pack()
    assert packed["input_ids"].tolist() == [1, 2, 3, 4, 5, 3, 7, 8, 9, 2, 6]
    assert packed["position_ids"].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 1, 2]
    assert packed["shift_labels"].tolist() == [-100, 3, 4, 5, -100, 7, 8, 9, -100, 6, -100]
    assert packed["token_index"].tolist() == [1, 2, 3, 1, 5, 6, 7, 9]
    assert packed["segment_id"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    assert packed["tree_cu_seqlens_q"].tolist() == [0, 1, 2, 5, 9, 11]
    assert packed["tree_kv_index"].tolist() == [0, 0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7, 8, 0, 9, 10]
    assert packed["tree_max_seqlens"].tolist() == [4, 6]
    assert not row.fits(sample([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 1]), 12)
    assert row.fits(sample([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 1]), 13)


def test_tree_attention_equals_causal_attention_per_sample():
    """Every packed position gets the output a separate causal pass over its own sample would give."""
    torch.manual_seed(0)
    samples = [[1, 2, 3, 4, 5], [1, 2, 3, 7, 8, 9], [1, 2, 6]]
    row = TreeRow()
    for ids in samples:
        row.add(sample(ids, [0] + [1] * (len(ids) - 1)))
    packed = row.pack()
    embed = torch.randn(10, 2, 4)  # token -> (heads, dim), shared by q/k/v for simplicity
    position_scale = torch.randn(8, 1, 1)

    def qkv(tokens, positions):
        x = embed[tokens] * position_scale[positions]
        return x.permute(1, 0, 2).unsqueeze(0)

    q = qkv(packed["input_ids"], packed["position_ids"])
    out, _ = tree_attention(
        None, q, q, q, None,
        tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=packed["tree_cu_seqlens_k"], tree_max_seqlen_q=4, tree_max_seqlen_k=6,
    )  # fmt: skip
    for ids, nodes in zip(samples, row.sample_nodes, strict=True):
        x = qkv(torch.tensor(ids), torch.arange(len(ids)))
        expected = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).transpose(1, 2)[0]
        positions = _positions(row, nodes)
        torch.testing.assert_close(out[0, positions], expected)


def _positions(row, nodes):
    order, _, _ = row._layout()
    where = {node: position for position, node in enumerate(order)}
    return [where[node] for node in nodes]


def _rollout(version, group):
    return RolloutSample(
        prompt=[], completion=[], input_ids=np.array([1, 2]), completion_mask=np.array([0, 1]),
        old_log_probs=np.zeros(2, dtype=np.float32), advantage=1.0, model_version=version, group_id=group, metrics={},
    )  # fmt: skip


def test_stale_samples_are_dropped_and_health_is_checked_when_idle():
    rollouts = queue.Queue()
    for group, version in enumerate([0, 3, 5, 1, 4]):
        rollouts.put(_rollout(version, group))
    metrics = defaultdict(list)
    checks = []

    def check(stale_after_s):
        checks.append(stale_after_s)
        raise RuntimeError("worker died")

    dataset = RolloutQueueDataset(rollouts, lambda: 5, check, 7.0, metrics, max_staleness=2, poll_interval_s=0.01)
    kept = []
    with pytest.raises(RuntimeError, match="worker died"):
        for item in dataset:
            kept.append(item["group_id"])
    assert kept == [1, 2, 4] and checks == [7.0]
    assert sum(metrics["sample/dropped_stale_total"]) == 2
    assert metrics["sample/staleness_max"] == [2.0, 0.0, 1.0]


def test_token_budget_keeps_groups_together_and_never_emits_empty_rows():
    stream = [sample([9, g, 1, 2, k], [0, 0, 0, 1, 1], group=g) for g in range(4) for k in range(3)]
    stream.insert(0, sample(list(range(30)), [1] * 30, group=99))
    metrics = defaultdict(list)
    planned = list(TokenBudgetBatcher(stream, 2, 12, metrics))
    assert metrics["batch/dropped_oversize_total"] == [1.0]
    for micro_batch in planned:
        assert len(micro_batch) == 2 and all(row.samples for row in micro_batch)
        assert all(len(row.tokens) <= 12 for row in micro_batch)
        assert not (micro_batch[0].groups & micro_batch[1].groups)


def test_fixed_count_splits_groups_over_rows():
    stream = [sample([1, 2, k], [0, 0, 1]) for k in range(3, 8)]
    (micro_batch,) = FixedCountBatcher(stream, 4, 5)
    assert [len(row.samples) for row in micro_batch] == [2, 1, 1, 1]


def test_collator_pads_rows_and_reports_token_counts():
    rows = [TreeRow(), TreeRow()]
    rows[0].add(sample([1, 2, 3], [0, 1, 1], group=0))
    rows[1].add(sample([4, 5, 6, 7, 8], [0, 0, 1, 1, 1], group=1))
    collator = DataCollatorForRollout(pad_token_id=0, num_processes=2, token_budget=8)
    batch = collator([rows])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["token_index"].tolist() == [[0, 1, -1], [1, 2, 3]]
    assert batch["global_n_tokens"].tolist() == [5.0, 5.0] and batch["global_n_forward_tokens"].tolist() == [8.0, 8.0]
    assert collator.groups_trained == {0, 1}
    assert collator.metrics["batch/pad_frac"] == [(2, 10)] and collator.metrics["batch/row_fill_frac"] == [(8, 16)]


def test_rank0_failure_is_relayed_as_a_micro_batch():
    """With several processes an error on rank 0 while planning or collating travels as a marked micro-batch."""
    from trl.experimental.async_grpo._ranks import RelayFailures, collate_or_relay, raise_relayed_failure

    rows = [TreeRow(), TreeRow()]
    rows[0].add(sample([1, 2, 3], [0, 1, 1], group=0))
    rows[1].add(sample([4, 5, 6], [0, 1, 1], group=1))

    def planner():
        yield rows
        raise RuntimeError("worker died") from ValueError("root cause")

    relay = RelayFailures(planner())
    collate = collate_or_relay(DataCollatorForRollout(pad_token_id=0, num_processes=2), 2, relay)
    normal, failure = [collate([item]) for item in relay]
    raise_relayed_failure(normal, relay)  # an ordinary micro-batch goes through
    assert failure["rank0_failure"].shape[0] == 2  # one copy per rank
    with pytest.raises(RuntimeError, match="^worker died$"):  # rank 0 raises its own error
        raise_relayed_failure(failure, relay)
    with pytest.raises(RuntimeError, match="Training stopped on rank 0.*worker died.*root cause"):  # another rank
        raise_relayed_failure({"rank0_failure": failure["rank0_failure"][1:]}, None)

    def broken_collator(examples):
        raise ValueError("cannot pack")

    broken = RelayFailures(iter([rows]))  # the collator itself fails
    (batch,) = [collate_or_relay(broken_collator, 2, broken)([item]) for item in broken]
    assert "rank0_failure" in batch and isinstance(broken.error, ValueError)


def test_reduce_metric_rules():
    assert _reduce_metric("loss", [1.0, 2.0]) == 1.5
    assert _reduce_metric("sample/dropped_stale_total", [1.0, 2.0]) == 3.0
    assert _reduce_metric("sample/staleness_max", [1.0, 3.0]) == 3.0
    assert _reduce_metric("clip_ratio/low_min", [1.0, 3.0]) == 1.0
    assert _reduce_metric("batch/pad_frac", [(1, 4), (1, 4)]) == 0.25
    assert math.isnan(_reduce_metric("x", [(1, 0)]))


def test_turn_reconciliation_realigns_small_drift_and_forks_large_drift():
    turns = [TurnRecord([1, 2, 3], [4, 5], [-0.4, -0.5]), TurnRecord([1, 2, 3, 4, 9, 6], [8], [-0.8])]
    (row,), stats = _chain_to_sequences(turns, "r", fork_threshold=4)
    assert row.input_ids == [1, 2, 3, 4, 9, 6, 8] and row.completion_mask == [0, 0, 0, 1, 0, 0, 1]
    assert stats["realign"] == 1 and stats["drift_tokens"] == 1
    rows, stats = _chain_to_sequences(turns, "r", fork_threshold=1)
    assert len(rows) == 2 and stats["fork"] == 1


def test_clipped_surrogate_loss_matches_hand_computation():
    log_probs = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    old = torch.tensor([-1.0, -1.0, -1.0])
    advantages = torch.tensor([1.0, 1.0, -1.0])
    loss, stats = clipped_surrogate_loss(log_probs, old, advantages, num_tokens=3, epsilon_low=0.2, epsilon_high=0.3)
    ratios = [1.0, math.exp(0.5), math.exp(-1.0)]
    # A = +1: -min(ρ, clip(ρ)); A = -1: -min(-ρ, -clip(ρ)) = max(ρ, clip(ρ)).
    terms = [-1.0, -min(ratios[1], 1.3), max(ratios[2], 0.8)]
    assert loss.item() == pytest.approx(sum(terms) / 3)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(1 / 3)
    assert stats["kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 3)
    loss.backward()
    assert log_probs.grad[1] == 0 and log_probs.grad[2] == 0 and log_probs.grad[0] != 0


def test_step_interval_callback():
    calls = []
    callback = StepIntervalCallback(lambda: calls.append(1), every_n_steps=2)

    class State:
        global_step = 0

    for step in range(1, 6):
        State.global_step = step
        callback.on_step_end(None, State, None)
    assert len(calls) == 2


def test_round_lora_rank():
    assert [round_lora_rank(r) for r in (1, 2, 16, 300)] == [1, 8, 16, 320]
    with pytest.raises(ValueError):
        round_lora_rank(513)


def test_lora_adapter_export_and_vllm_names(tmp_path):
    peft = pytest.importorskip("peft")
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from trl.assets import get_model_path

    base = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    dest = tmp_path / ".vllm_lora" / "trl-policy-v1"
    save_lora_adapter(model, Accelerator(cpu=True), "default", str(dest))
    assert sorted(os.listdir(dest)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((dest / "adapter_config.json").read_text())["r"] == 4
    assert [p for p in os.listdir(dest.parent) if p.startswith(".")] == []
    names = [name for name, _ in _iter_vllm_named_params(model)]
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("lora_" in name or "base_layer" in name or name.startswith("base_model") for name in names)


# ---------------------------------------------------------------------------------------------------------------------
# The trainer and the rollout worker, end to end with an in-process generation backend
# ---------------------------------------------------------------------------------------------------------------------
TINY = "tiny-Qwen2ForCausalLM"


class LocalBackend:
    """A generation backend on a private copy of the tiny model (`generate`), standing in for a vLLM server."""

    def __init__(self, path, fail_after=None, unreachable=False):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        self.lock = __import__("threading").Lock()
        self.calls = 0
        self.fail_after = fail_after
        self.unreachable = unreachable
        self.adapters_used = []

    def check_ready(self, timeout):
        if self.unreachable:
            raise ConnectionError("generation server not reachable at http://fake:1")

    def generate(self, prompt_ids, n, sampling):
        self.calls += 1
        self.adapters_used.append((sampling.get("lora_name"), sampling["model"]))
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("backend exploded")
        with self.lock, torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt_ids] * n), attention_mask=torch.ones(n, len(prompt_ids), dtype=torch.long),
                do_sample=True, temperature=sampling["temperature"], top_k=sampling["top_k"] or None, top_p=1.0,
                max_new_tokens=sampling["max_tokens"], output_scores=True, return_dict_in_generate=True,
                pad_token_id=self.model.config.eos_token_id,
            )  # fmt: skip
        tokens = out.sequences[:, len(prompt_ids) :]
        logps = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
        sampled = logps.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return [(tokens[i].tolist(), sampled[i].tolist()) for i in range(n)]


class LocalTransfer:
    """Weight transfer into the local backend's model, recording the versions pushed."""

    def __init__(self, backend):
        self.backend = backend
        self.events = []

    def init_weight_transfer(self):
        self.events.append("init")

    def pause(self):
        self.events.append("pause")

    def send_weights(self, iterator):
        state = {name: tensor.detach().clone() for name, tensor in iterator}
        with self.backend.lock:
            missing = self.backend.model.load_state_dict(state, strict=False)
        assert not missing.unexpected_keys
        self.events.append(("send", len(state)))

    def resume(self):
        self.events.append("resume")

    def destroy(self):
        self.events.append("destroy")


def even_first_token(completion_ids, **kwargs):
    return [1.0 if ids and ids[0] % 2 == 0 else 0.0 for ids in completion_ids]


PROMPT = [{"role": "user", "content": "Say 0."}]


def _trainer(
    tmp_path,
    backend,
    transfer,
    poll=0.2,
    reward_funcs=even_first_token,
    peft_config=None,
    lora_server=None,
    train_dataset="six prompts",
    trainer_kwargs=None,
    **overrides,
):
    from datasets import Dataset

    from trl.assets import get_model_path
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    class LocalAsyncGRPOTrainer(AsyncGRPOTrainer):
        _poll_interval_s = poll

        def _build_generation_backend(self):
            return backend

    if lora_server is not None:
        LocalAsyncGRPOTrainer._build_lora_client = lambda self: lora_server

    config = {
        "output_dir": str(tmp_path), "use_cpu": True, "max_steps": 3, "per_device_train_batch_size": 4,
        "num_generations": 4, "max_completion_length": 4, "token_budget": 256, "learning_rate": 0.05,
        "report_to": "none", "save_strategy": "no", "heartbeat_stale_after_s": 60.0,
    }  # fmt: skip
    config.update(overrides)
    # The default: six copies of PROMPT (None is passed on: no dataset).
    dataset = Dataset.from_dict({"prompt": [PROMPT] * 6}) if isinstance(train_dataset, str) else train_dataset
    return LocalAsyncGRPOTrainer(
        get_model_path(TINY),
        reward_funcs=reward_funcs,
        args=AsyncGRPOConfig(**config),
        train_dataset=dataset,
        weight_transfer=transfer,
        peft_config=peft_config,
        **(trainer_kwargs or {}),
    )


def _first_token_log_probs(model, tokenizer):
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)


@pytest.mark.timeout(300)
def test_trainer_learns_toy_reward_syncs_weights_and_logs(tmp_path):
    from transformers import AutoTokenizer

    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY))
    transfer = LocalTransfer(backend)
    # Toy task: the tiny model's first-token distribution is nearly flat; sampled at a low temperature it is a choice
    # between a few tokens. Rewarding the second likeliest one must make it gain on the likeliest.
    tokenizer = AutoTokenizer.from_pretrained(get_model_path(TINY))
    first, second = _first_token_log_probs(backend.model, tokenizer).topk(2)[1].tolist()

    def second_choice(completion_ids, **kwargs):
        return [float(bool(ids) and ids[0] == int(second)) for ids in completion_ids]

    trainer = _trainer(
        tmp_path, backend, transfer, reward_funcs=second_choice, max_steps=6, temperature=0.02, learning_rate=1e-4
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    log_probs = _first_token_log_probs(backend.model, tokenizer)
    gap_before = float(log_probs[second] - log_probs[first]) / 0.02
    trainer.train()
    # Parameters moved, and every step pushed them (initial sync + one per step), versions 1..7.
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert trainer.model_version == 7
    assert transfer.events[0] == "init" and transfer.events[-1] == "destroy"
    assert sum(1 for e in transfer.events if isinstance(e, tuple)) == 7
    for name, param in trainer.model.named_parameters():
        assert torch.equal(dict(backend.model.named_parameters())[name], param.detach())
    # The toy reward was learned: the rewarded token gained on the other one.
    log_probs = _first_token_log_probs(backend.model, tokenizer)
    gap_after = float(log_probs[second] - log_probs[first]) / 0.02
    assert gap_after > gap_before + 1.0, (gap_before, gap_after)
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    assert rewards[-1] > rewards[0], rewards
    # Clean shutdown: the worker thread ended.
    assert not trainer.rollout_worker._thread.is_alive()
    logged = {key for entry in trainer.state.log_history for key in entry}
    expected = {
        "loss", "ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
        "clip_ratio/low_min", "clip_ratio/high_max", "reward", "reward_std", "rewards/second_choice",
        "sample/staleness_mean", "sample/staleness_max", "sample/rollout_queue_size", "sample/time_in_queue_s",
        "batch/packing_ratio", "batch/row_fill_frac", "perf/step_s", "perf/fwd_bwd_s", "perf/optimizer_s",
        "perf/rollout_wait_s", "perf/weight_sync_s", "perf/weight_sync_transfer_s", "batch/samples_per_step",
        "batch/groups_per_step", "batch/trained_tokens_per_step", "rollout/duration_s", "completions/mean_length",
    }  # fmt: skip
    assert expected <= logged, expected - logged


@pytest.mark.timeout(300)
def test_stale_samples_are_dropped_and_counted(tmp_path):
    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY))
    # max_staleness=0: samples generated before the latest sync are dropped; a deep queue guarantees some are.
    trainer = _trainer(tmp_path, backend, LocalTransfer(backend), max_steps=3, max_staleness=0)
    trainer.train()
    dropped = sum(entry.get("sample/dropped_stale_total") or 0 for entry in trainer.state.log_history)
    assert dropped > 0


@pytest.mark.timeout(120)
def test_worker_failure_stops_training_with_its_error(tmp_path):
    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY), fail_after=1)
    trainer = _trainer(tmp_path, backend, LocalTransfer(backend), max_steps=50, per_device_train_batch_size=8)
    with pytest.raises(RuntimeError, match="rollout worker failed") as info:
        trainer.train()
    assert "backend exploded" in repr(info.value.__cause__)
    assert trainer.rollout_worker._stop.is_set()


@pytest.mark.timeout(120)
def test_unreachable_backend_fails_before_training(tmp_path):
    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY), unreachable=True)
    transfer = LocalTransfer(backend)
    trainer = _trainer(tmp_path, backend, transfer)
    with pytest.raises(RuntimeError, match="failed to start") as info:
        trainer.train()
    assert isinstance(info.value.__cause__, ConnectionError)
    assert trainer.state.global_step == 0


@pytest.mark.timeout(60)
def test_default_server_unreachable_is_a_clear_error(tmp_path):
    from datasets import Dataset

    from trl.assets import get_model_path
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    args = AsyncGRPOConfig(
        str(tmp_path), use_cpu=True, max_steps=1, vllm_server_base_url="http://127.0.0.1:9", vllm_server_timeout=0.5
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Hi"}]]})
    with pytest.raises(ConnectionError, match="vLLM server can't be reached"):
        AsyncGRPOTrainer(get_model_path(TINY), reward_funcs=even_first_token, args=args, train_dataset=dataset)


@pytest.mark.timeout(300)
def test_lora_policy_syncs_merged_weights(tmp_path):
    peft = pytest.importorskip("peft")
    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY))
    transfer = LocalTransfer(backend)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = _trainer(tmp_path, backend, transfer, max_steps=2, learning_rate=1e-2, peft_config=lora)
    trainer.train()
    model = trainer.model
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    model.merge_adapter()
    try:
        merged = {name: param.detach().clone() for name, param in _iter_vllm_named_params(model)}
    finally:
        model.unmerge_adapter()
    served = dict(backend.model.named_parameters())
    name = "model.layers.0.self_attn.q_proj.weight"
    # The server holds the merged policy (base + trained adapter), and the trainer's base weights stay unmerged.
    assert torch.allclose(served[name], merged[name])
    assert not torch.allclose(served[name], layer.base_layer.weight)
    assert sum(1 for event in transfer.events if isinstance(event, tuple)) == 3


@pytest.mark.timeout(300)
def test_epoch_budget_stops_training_and_checkpoints_rollout_state(tmp_path):
    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY))
    trainer = _trainer(
        tmp_path, backend, LocalTransfer(backend), max_steps=-1, num_train_epochs=1, save_strategy="steps",
        save_steps=1000, token_budget=0, per_device_train_batch_size=8,
    )  # fmt: skip
    trainer.train()
    # 6 prompts, one epoch: training stops once 6 distinct groups were collated (8 samples, 2 groups per step; the
    # dataloader collates one micro-batch ahead), far below the safety ceiling of max_steps.
    assert 2 <= trainer.state.global_step <= 3 and trainer.state.max_steps == 96
    assert len(trainer.data_collator.groups_trained) >= 6
    state = json.loads((tmp_path / f"checkpoint-{trainer.state.global_step}" / "rollout_state.json").read_text())
    assert state["model_version"] == trainer.model_version
    assert state["prompt_index"] >= 1


class StubLoraServer:
    """A generation server's runtime-LoRA surface (`/server_info`, load, unload), recording what it is asked."""

    def __init__(self, max_lora_rank=16, max_loras=4):
        self.lora_config = {"max_lora_rank": max_lora_rank, "max_loras": max_loras}
        self.events = []
        self.loaded = {}

    def get_server_info(self):
        return {"lora_config": self.lora_config, "parallel_config": {"data_parallel_size": 1}}

    def load_lora_adapter(self, lora_name, lora_path):
        assert os.path.isfile(os.path.join(lora_path, "adapter_config.json"))
        assert lora_name not in self.loaded
        self.loaded[lora_name] = lora_path
        self.events.append(("load", lora_name))

    def unload_lora_adapter(self, lora_name):
        self.loaded.pop(lora_name)
        self.events.append(("unload", lora_name))


@pytest.mark.timeout(300)
def test_lora_policy_syncs_adapter_only(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY))
    transfer = LocalTransfer(backend)
    server = StubLoraServer()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = _trainer(
        tmp_path, backend, transfer, max_steps=4, max_staleness=1, learning_rate=1e-2, peft_config=lora,
        lora_server=server,
    )  # fmt: skip
    assert trainer._adapter_sync
    trainer.train()
    # Versions 1 (train begin) to 5; version N unloads N - 2 and deletes the directory of N - 3 (max_staleness=1).
    assert trainer.model_version == 5
    assert server.events == [
        ("load", "trl-policy-v1"), ("load", "trl-policy-v2"),
        ("load", "trl-policy-v3"), ("unload", "trl-policy-v1"),
        ("load", "trl-policy-v4"), ("unload", "trl-policy-v2"),
        ("load", "trl-policy-v5"), ("unload", "trl-policy-v3"),
    ]  # fmt: skip
    root = tmp_path / ".vllm_lora"
    assert sorted(os.listdir(root)) == ["trl-policy-v3", "trl-policy-v4", "trl-policy-v5"]
    # No weight-transfer group and no full weights: only pause/resume around each sync.
    assert transfer.events == ["pause", "resume"] * 5
    # The rollout worker generated with the loaded adapters only (name as `lora_name` and as the OpenAI `model`).
    assert backend.adapters_used and all(name == model for name, model in backend.adapters_used)
    assert {name for name, _ in backend.adapters_used} <= {f"trl-policy-v{v}" for v in range(1, 6)}
    # The last adapter on disk is the trained policy's, and PEFT loads it.
    from safetensors.torch import load_file

    saved = load_file(str(root / "trl-policy-v5" / "adapter_model.safetensors"))
    current = peft.get_peft_model_state_dict(trainer.model)
    assert saved.keys() == current.keys()
    assert all(torch.equal(saved[key], current[key].cpu()) for key in saved)
    base = AutoModelForCausalLM.from_pretrained(get_model_path(TINY))
    served = peft.PeftModel.from_pretrained(base, str(root / "trl-policy-v5"))
    assert served.peft_config["default"].r == 4


@pytest.mark.timeout(120)
def test_adapter_sync_rank_above_server_limit_fails_before_training(tmp_path):
    peft = pytest.importorskip("peft")
    from trl.assets import get_model_path

    backend = LocalBackend(get_model_path(TINY))
    lora = peft.LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="--max-lora-rank 16"):
        _trainer(tmp_path, backend, LocalTransfer(backend), peft_config=lora, lora_server=StubLoraServer(8))
    # A server without LoRA support: merged weights, as before.
    server = StubLoraServer()
    server.lora_config = None
    trainer = _trainer(tmp_path, backend, LocalTransfer(backend), peft_config=lora, lora_server=server)
    assert not trainer._adapter_sync


def test_adapter_sync_needs_a_worker_taking_the_adapter_name():
    from trl.experimental.async_grpo.async_grpo_trainer import _check_worker_takes_lora_name

    class OldWorker:
        def update_model_version(self, model_version):
            pass

    class NewWorker:
        def update_model_version(self, model_version, lora_name=None):
            pass

    with pytest.raises(ValueError, match="lora_name"):
        _check_worker_takes_lora_name(OldWorker())
    _check_worker_takes_lora_name(NewWorker())

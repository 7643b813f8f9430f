"""Parity cases: the pure pieces of `trl.experimental.async_grpo` on fixed inputs (config, prefix-tree packing,
staleness dropping, token-budget and fixed-count planning, the rollout collator, metric reduction, turn
reconciliation, LoRA adapter-sync decisions). The trainer itself needs a vLLM server and FlashAttention 3 in TRL, so
it is not run here."""

from __future__ import annotations

from . import QWEN, case, to_jsonable


def _silent_state():
    from accelerate import PartialState

    PartialState()  # TRL logs through accelerate's logger, which needs a state


def _sample(ids, mask, group, advantage, rng):
    import numpy as np

    return {
        "input_ids": np.array(ids),
        "completion_mask": np.array(mask),
        "old_log_probs": rng.normal(size=len(ids)).astype(np.float32),
        "advantage": advantage,
        "group_id": group,
        "metrics": {"reward": float(group % 3), "rewards/f": float(advantage)},
    }


def _stream(seed: int) -> tuple[list[dict], int, int, int]:
    """A reproducible stream of grouped samples sharing prompt prefixes, plus (processes, budget, micro-batch size)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    stream = []
    group_size = int(rng.integers(1, 5))
    for group in range(int(rng.integers(3, 9))):
        prompt = list(rng.integers(1, 6, size=int(rng.integers(1, 5))))
        for _ in range(group_size):
            length = int(rng.integers(1, 7))
            completion = list(rng.integers(1, 6, size=length))
            mask = [0] * len(prompt) + list(rng.integers(0, 2, size=length))
            stream.append(_sample(prompt + completion, mask, group, float(rng.normal()), rng))
    processes = int(rng.integers(1, 4))
    return stream, processes, int(rng.integers(6, 20)), int(rng.integers(processes, 7))


def _layout(micro_batches) -> list:
    return [[[(int(s["group_id"]), len(s["input_ids"])) for s in row.samples] for row in mb] for mb in micro_batches]


def _tensors(batch: dict) -> dict:
    return {key: {"dtype": str(value.dtype), "values": value.tolist()} for key, value in batch.items()}


@case("dataclasses/AsyncGRPOConfig")
def _config_fields(ctx):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from .dataclass_fields import _fields

    return _fields(AsyncGRPOConfig)


@case("async_grpo/config_post_init")
def _config_post_init(ctx):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    args = AsyncGRPOConfig(
        ctx.tmpdir(), use_cpu=True, model_init_kwargs='{"dtype": "float32"}', chat_template_kwargs='{"a": 1}'
    )
    return {
        "split_batches": args.accelerator_config.split_batches,
        "dispatch_batches": args.accelerator_config.dispatch_batches,
        "model_init_kwargs": args.model_init_kwargs,
        "chat_template_kwargs": args.chat_template_kwargs,
        "logging_steps": args.logging_steps,
        "lr_scheduler_type": str(args.lr_scheduler_type),
        "gradient_checkpointing": args.gradient_checkpointing,
        "ignore_data_skip": args.ignore_data_skip,
    }


@case("async_grpo/tree_row_pack")
def _tree_row_pack(ctx):
    import numpy as np

    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow

    rng = np.random.default_rng(0)
    out = {"name": TREE_ATTENTION, "rows": []}
    for seed in range(6):
        stream, _, budget, _ = _stream(seed)
        row, fits = TreeRow(), []
        for sample in stream:
            fits.append(row.fits(sample, budget))
            row.add(sample)
        out["rows"].append({"fits": fits, "load": row.load, "trained": row.trained, "pack": _tensors(row.pack())})
    row = TreeRow()
    row.add(_sample([5], [1], 0, 1.0, rng))
    row.add(_sample([5, 6], [0, 1], 0, 1.0, rng))
    out["single_token_root"] = _tensors(row.pack())
    return out


@case("async_grpo/token_budget_batching")
def _token_budget(ctx):
    from collections import defaultdict

    from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher

    _silent_state()
    out = []
    for seed in range(25):
        stream, processes, budget, _ = _stream(seed)
        metrics = defaultdict(list)
        planned = list(TokenBudgetBatcher(stream, processes, budget, metrics))
        out.append({"layout": _layout(planned), "metrics": dict(metrics)})
    return {"runs": out}


@case("async_grpo/fixed_count_batching")
def _fixed_count(ctx):
    from trl.experimental.async_grpo.async_grpo_trainer import FixedCountBatcher

    out = []
    for seed in range(25):
        stream, processes, _, micro_batch = _stream(seed)
        out.append(_layout(FixedCountBatcher(stream, processes, micro_batch)))
    return {"runs": out}


@case("async_grpo/collator")
def _collator(ctx):
    from collections import defaultdict

    from trl.experimental.async_grpo.async_grpo_trainer import (
        DataCollatorForRollout,
        FixedCountBatcher,
        TokenBudgetBatcher,
    )

    _silent_state()
    out = []
    for seed in range(10):
        stream, processes, budget, micro_batch = _stream(seed)
        planned = [(mb, budget) for mb in list(TokenBudgetBatcher(stream, processes, budget, defaultdict(list)))[:2]]
        planned += [(mb, 0) for mb in list(FixedCountBatcher(stream, processes, micro_batch))[:2]]
        for micro_batch_rows, token_budget in planned:
            collator = DataCollatorForRollout(pad_token_id=0, num_processes=processes, token_budget=token_budget)
            batch = collator([micro_batch_rows])
            out.append(
                {
                    "batch": _tensors(batch),
                    "metrics": dict(collator.metrics),
                    "groups": sorted(collator.groups_trained),
                }
            )
    return {"batches": out}


@case("async_grpo/staleness")
def _staleness(ctx):
    import queue
    from collections import defaultdict

    import numpy as np

    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    _silent_state()

    class _Stop(Exception):
        pass

    def unhealthy(stale_after_s):
        raise _Stop(stale_after_s)

    out = {}
    for max_staleness, current in [(3, 7), (0, 5), (4, 4)]:
        rollouts = queue.Queue()
        for index, version in enumerate([0, 1, 5, 6, 2, 7, 3, 4, 4]):
            rollouts.put(
                RolloutSample(
                    prompt=[{"role": "user", "content": "p"}],
                    completion=[{"role": "assistant", "content": "c"}],
                    input_ids=np.array([1, 2, 3]),
                    completion_mask=np.array([0, 1, 1]),
                    old_log_probs=np.array([0.0, -1.0, -2.0], dtype=np.float32),
                    advantage=0.5,
                    model_version=version,
                    group_id=index,
                    metrics={"reward": 1.0},
                )
            )
        metrics = defaultdict(list)
        dataset = RolloutQueueDataset(
            rollouts, lambda v=current: v, unhealthy, 12.0, metrics, max_staleness=max_staleness, poll_interval_s=0.01
        )
        kept, stop = [], None
        try:
            for item in dataset:
                kept.append({key: to_jsonable(value) for key, value in item.items()})
        except _Stop as exc:
            stop = exc.args[0]
        out[f"max_staleness={max_staleness},version={current}"] = {
            "kept": kept,
            "metrics": dict(metrics),
            "stop": stop,
        }
    return out


@case("async_grpo/reduce_metric")
def _reduce(ctx):
    from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

    nan = float("nan")
    inputs = [
        ("loss", [1.0, 2.0]),
        ("sample/dropped_stale_total", [1, 2]),
        ("sample/staleness_max", [1, 3]),
        ("x/min_len", [1, 3]),
        ("batch/packing_ratio", [(2.0, 4.0), (1.0, 1.0)]),
        ("a", [nan]),
        ("totally", [1, 2]),
        ("max/x", [1, 2]),
        ("m_max", [1.0, nan]),
        ("a/b_min", [3, nan, 1]),
        ("d", [(1.0, 0.0)]),
        ("tools/search/call_total", [1.0, 4.0]),
    ]
    return {key: repr(_reduce_metric(key, values)) for key, values in inputs}


@case("async_grpo/round_lora_rank")
def _round_rank(ctx):
    from trl.experimental.async_grpo.async_grpo_trainer import VLLM_LORA_RANKS, round_lora_rank

    out = {"ranks": list(VLLM_LORA_RANKS)}
    for rank in [0, 1, 2, 8, 9, 300, 320, 321, 512, 513]:
        try:
            out[str(rank)] = round_lora_rank(rank)
        except ValueError:
            out[str(rank)] = "ValueError"
    return out


@case("async_grpo/chain_to_sequences")
def _chain(ctx):
    from trl.experimental.async_grpo.async_rollout_worker import (
        DriftKind,
        TurnRecord,
        _chain_to_sequences,
        _common_prefix_len,
    )

    chains = [
        [TurnRecord([1, 2, 3], [4, 5], [-0.4, -0.5])],
        [TurnRecord([1, 2, 3], [4, 5], [-0.4, -0.5]), TurnRecord([1, 2, 3, 4, 5, 6, 7], [8], [-0.8])],
        [TurnRecord([1, 2, 3], [4, 5], [-0.4, -0.5]), TurnRecord([1, 2, 3, 4, 9, 6, 7], [8], [-0.8])],
        [TurnRecord([1, 2, 3], [4, 5], [-0.4, -0.5]), TurnRecord([1, 2, 9, 6, 7], [8], [-0.8])],
        [TurnRecord([1, 2, 3], [4, 5], [-0.4, -0.5]), TurnRecord([1, 2, 3, 4], [8], [-0.8])],
        [TurnRecord([1, 2, 3], [4, 5], [-0.4, -0.5], [1, 0]), TurnRecord([1, 2, 3, 4, 5, 6], [], [])],
        [TurnRecord([1, 2, 3], [], []), TurnRecord([1, 2, 3, 7], [8, 9], [-0.8, -0.9])],
        [TurnRecord([1, 2, 3], [4, 5, 6, 7], [-0.4] * 4), TurnRecord([1, 2, 3, 4, 5, 9, 9], [8], [-0.8])],
        [TurnRecord([1, 2], [3], [-0.3], [0])],
    ]
    out = {"kinds": [(kind.name, kind.value) for kind in DriftKind]}
    for threshold in (1024, 1, 0):
        for index, chain in enumerate(chains):
            rows, stats = _chain_to_sequences(chain, "r", threshold)
            out[f"{threshold}/{index}"] = {"rows": to_jsonable([vars(row) for row in rows]), "stats": stats}
    out["prefix"] = [
        _common_prefix_len([1, 2, 3], [1, 2, 4]),
        _common_prefix_len([], [1]),
        _common_prefix_len([1], [1]),
    ]
    return out


@case("async_grpo/select_adapter_sync")
def _adapter_sync(ctx):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync, validate_lora_for_vllm_sync

    _silent_state()
    args = AsyncGRPOConfig(ctx.tmpdir(), use_cpu=True, max_staleness=2)
    servers = [
        {"lora_config": None},
        {"lora_config": {"max_lora_rank": 16, "max_loras": 4}, "parallel_config": {"data_parallel_size": 1}},
        {"lora_config": {"max_lora_rank": 16, "max_loras": 3}, "parallel_config": {"data_parallel_size": 1}},
        {"lora_config": {"max_lora_rank": 8, "max_loras": 8}, "parallel_config": {"data_parallel_size": 2}},
        {"lora_config": {"max_lora_rank": 16, "max_loras": 8}, "parallel_config": {"data_parallel_size": 1}},
    ]
    adapters = {
        "plain": {},
        "bias=all": {"bias": "all"},
        "dora": {"use_dora": True},
        "modules_to_save": {"modules_to_save": ["lm_head"]},
        "lm_head_target": {"target_modules": ["q_proj", "lm_head"]},
        "r=20": {"r": 20},
        "rank_pattern": {"rank_pattern": {"q_proj": 40}},
    }
    out = {}
    for name, overrides in adapters.items():
        config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **overrides}
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(ctx.model(QWEN)), LoraConfig(**config))
        try:
            validated = f"ok r={validate_lora_for_vllm_sync(model).r}"
        except ValueError:
            validated = "ValueError"
        decisions = []
        for server in servers:
            try:
                decisions.append(select_adapter_sync(server, model, args))
            except ValueError:
                decisions.append("ValueError")
        out[name] = {"validate": validated, "decisions": decisions}
    return out

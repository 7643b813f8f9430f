"""Parity cases: the pure pieces of `trl.experimental.async_distillation` on fixed inputs (config, staleness
dropping, token-budget and fixed-count planning, the padding-free rollout collator). The trainer itself needs vLLM
servers and FlashAttention 3 in TRL, so it is not run here."""

from __future__ import annotations

from . import case


def _silent_state():
    from accelerate import PartialState

    PartialState()


def _stream(seed: int, teachers: tuple[str, ...] = ("default",)) -> tuple[list[dict], int, int, int]:
    """A reproducible stream of distillation samples, plus (processes, budget, micro-batch size)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    k, stream = 2, []
    for prompt_id in range(int(rng.integers(3, 12))):
        prompt, completion = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        length = prompt + completion
        ids = np.full((length, k + 1), -1, dtype=np.int64)
        lps = np.full((length, k + 1), -np.inf, dtype=np.float32)
        ids[prompt:, :k] = rng.integers(0, 50, size=(completion, k))
        lps[prompt:, :k] = -rng.random(size=(completion, k)).astype(np.float32)
        stream.append(
            {
                "input_ids": rng.integers(1, 50, size=length),
                "completion_mask": np.array([0] * prompt + [1] * completion),
                "teacher_topk_ids": ids,
                "teacher_topk_logprobs": lps,
                "teacher_id": teachers[prompt_id % len(teachers)],
                "prompt_id": prompt_id,
                "metrics": {},
            }
        )
    processes = int(rng.integers(1, 4))
    return stream, processes, int(rng.integers(8, 24)), int(rng.integers(processes, 7))


def _layout(micro_batches) -> list:
    return [
        [[(int(s["prompt_id"]), len(s["input_ids"])) for s in getattr(row, "samples", row)] for row in mb]
        for mb in micro_batches
    ]


@case("dataclasses/AsyncDistillationConfig")
def _config_fields(ctx):
    from trl.experimental.async_distillation import AsyncDistillationConfig

    from .dataclass_fields import _fields

    return _fields(AsyncDistillationConfig)


@case("async_distillation/config_post_init")
def _config_post_init(ctx):
    from trl.experimental.async_distillation import AsyncDistillationConfig

    out = {}
    for name, kwargs in {
        "default": {},
        "json": {"teacher_server_urls": '{"a": "http://h:1", "b": "http://h:2"}', "model_init_kwargs": '{"x": 1}'},
        "string": {"teacher_server_urls": "http://h:3"},
    }.items():
        args = AsyncDistillationConfig(ctx.tmpdir(), use_cpu=True, **kwargs)
        out[name] = {
            "teacher_server_urls": args.teacher_server_urls,
            "model_init_kwargs": args.model_init_kwargs,
            "split_batches": args.accelerator_config.split_batches,
            "dispatch_batches": args.accelerator_config.dispatch_batches,
            "lr_scheduler_type": str(args.lr_scheduler_type),
            "logging_steps": args.logging_steps,
            "ignore_data_skip": args.ignore_data_skip,
        }
    for name, kwargs in {"empty": {"teacher_server_urls": {}}, "beta": {"beta": 1.5}}.items():
        try:
            AsyncDistillationConfig(ctx.tmpdir(), use_cpu=True, **kwargs)
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    return out


@case("async_distillation/token_budget_batching")
def _token_budget(ctx):
    from collections import defaultdict

    from trl.experimental.async_distillation.async_distillation_trainer import TokenBudgetBatcher

    _silent_state()
    out = []
    for seed in range(25):
        stream, processes, budget, _ = _stream(seed)
        metrics = defaultdict(list)
        out.append(
            {"layout": _layout(TokenBudgetBatcher(stream, processes, budget, metrics)), "metrics": dict(metrics)}
        )
    return {"runs": out}


@case("async_distillation/fixed_count_batching")
def _fixed_count(ctx):
    from trl.experimental.async_distillation.async_distillation_trainer import FixedCountBatcher

    return {"runs": [_layout(FixedCountBatcher(*_stream(seed)[:2], _stream(seed)[3])) for seed in range(25)]}


@case("async_distillation/collator")
def _collator(ctx):
    from collections import defaultdict

    from trl.experimental.async_distillation.async_distillation_trainer import (
        DataCollatorForRollout,
        FixedCountBatcher,
    )

    out = []
    for seed, teachers in ((0, ("default",)), (1, ("a", "b")), (2, ("a", "b", "c"))):
        stream, processes, _, micro_batch = _stream(seed, teachers)
        metrics = defaultdict(list)
        collator = DataCollatorForRollout(
            pad_token_id=0,
            num_processes=processes,
            teacher_id_to_idx={t: i for i, t in enumerate(teachers)},
            metrics=metrics,
            token_budget=32,
        )
        for planned in FixedCountBatcher(stream, processes, micro_batch):
            batch = collator([planned])
            out.append(
                {
                    "batch": {k: {"dtype": str(v.dtype), "values": v.tolist()} for k, v in batch.items()},
                    "metrics": {k: [list(x) if isinstance(x, tuple) else x for x in v] for k, v in metrics.items()},
                    "trained": sorted(collator.prompts_trained),
                }
            )
            metrics.clear()
    return {"batches": out}


@case("async_distillation/staleness")
def _staleness(ctx):
    import queue
    from collections import defaultdict

    from trl.experimental.async_distillation.async_distillation_trainer import RolloutQueueDataset
    from trl.experimental.async_distillation.async_rollout_worker import RolloutSample

    stream, _, _, _ = _stream(3)
    q = queue.Queue()
    for version, sample in enumerate(stream):
        q.put(RolloutSample(prompt=[], completion=[], model_version=version % 7, **sample))
    metrics = defaultdict(list)
    dataset = RolloutQueueDataset(q, lambda: 6, lambda s: None, 60.0, metrics, max_staleness=2, poll_interval_s=0.01)
    items = iter(dataset)
    kept = [next(items) for _ in range(sum(1 for v in range(len(stream)) if 6 - v % 7 <= 2))]
    return {
        "kept": [(int(item["prompt_id"]), sorted(item)) for item in kept],
        "dropped": len(metrics["sample/dropped_stale_total"]),
        "staleness": metrics["sample/staleness_mean"],
    }

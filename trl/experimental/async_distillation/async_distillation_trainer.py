"""Asynchronous distillation: the trainer side (rank 0 reads the queue, plans padding-free rows, trains, syncs).

The machinery is AsyncGRPO's ([`~trl.experimental.async_grpo.AsyncGRPOTrainer`]: rollout worker, bounded queue,
staleness drop, weight sync with versions, `rollout_state.json`, metric reduction); what differs is the data (one
completion per prompt with its teacher's candidates), the planning (rows of whole sequences balanced by the sum of
squared lengths, packed padding-free with `position_ids` restarting at each sequence) and the loss (a sparse-support
divergence to the teacher, [`~trl.trainer.utils.sparse_divergence`]).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ...trainer.utils.packing import (
    packed_attention_kind,
    packed_sdpa_applicable,
    packed_sdpa_attention,
    sequence_boundaries,
)
from ...trainer.utils.sparse_divergence import add_tail_bucket, renormalize_on_support, sparse_support_divergence
from ..async_grpo._batching import RolloutQueueDataset as _AsyncGRPORolloutQueueDataset
from ..async_grpo._batching import log_rollout_traces, log_sample_and_row_metrics
from ..async_grpo._lora_sync import (
    round_lora_rank,
    save_lora_adapter,
    select_adapter_sync,
    validate_lora_for_vllm_sync,
)
from ..async_grpo._ranks import rank0_call
from ..async_grpo.async_grpo_trainer import (
    AsyncGRPOTrainer,
    RolloutWorkerProtocol,
    StepIntervalCallback,
    WeightTransferProtocol,
    _load_init_kwargs,
)
from ..async_grpo.vllm_client import VLLMClient
from ..async_grpo.weight_transfer import WeightTransferClient
from .async_distillation_config import AsyncDistillationConfig
from .async_rollout_worker import AsyncRolloutWorker, RolloutSample


__all__ = [
    "AsyncDistillationConfig",
    "AsyncDistillationTrainer",
    "AsyncRolloutWorker",
    "DataCollatorForRollout",
    "FixedCountBatcher",
    "RolloutQueueDataset",
    "RolloutSample",
    "RolloutWorkerProtocol",
    "StepIntervalCallback",
    "TokenBudgetBatcher",
    "VLLMClient",
    "WeightTransferClient",
    "WeightTransferProtocol",
    "log_rollout_traces",
    "round_lora_rank",
    "save_lora_adapter",
    "select_adapter_sync",
    "validate_lora_for_vllm_sync",
]


class RolloutQueueDataset(_AsyncGRPORolloutQueueDataset):
    """AsyncGRPO's queue reader (staleness drop, health checks, queue metrics) yielding distillation samples."""

    _item_fields = (
        "input_ids",
        "completion_mask",
        "teacher_topk_ids",
        "teacher_topk_logprobs",
        "teacher_id",
        "prompt_id",
        "metrics",
    )


def _cost(samples: list[dict]) -> int:
    return sum(len(sample["input_ids"]) ** 2 for sample in samples)


class FixedCountBatcher(IterableDataset):
    """Micro-batches of `microbatch_size` samples split into `num_processes` rows balancing the sum of squared
    lengths (longest first, each into the row with the smallest sum so far)."""

    def __init__(self, dataset: Iterable[dict], num_processes: int, microbatch_size: int):
        self.dataset = dataset
        self.num_processes = num_processes
        self.microbatch_size = max(microbatch_size, num_processes)

    def _plan(self, buffer: list[dict]) -> list[list[dict]]:
        rows: list[list[dict]] = [[] for _ in range(self.num_processes)]
        for sample in sorted(buffer, key=lambda s: len(s["input_ids"]), reverse=True):
            min(rows, key=_cost).append(sample)
        return rows

    def __iter__(self) -> Iterator[list[list[dict]]]:
        buffer: list[dict] = []
        for sample in self.dataset:
            buffer.append(sample)
            if len(buffer) == self.microbatch_size:
                yield self._plan(buffer)
                buffer = []


class TokenBudgetBatcher(IterableDataset):
    """Micro-batches of `num_processes` rows of at most `token_budget` tokens: each sample goes to the fitting row
    with the smallest sum of squared lengths; when none fits the micro-batch is emitted and a new one started.
    Samples longer than the budget are dropped (`batch/dropped_oversize_total`)."""

    def __init__(self, dataset: Iterable[dict], num_processes: int, token_budget: int, metrics: dict):
        self.dataset = dataset
        self.num_processes = num_processes
        self.token_budget = token_budget
        self.metrics = metrics

    def __iter__(self) -> Iterator[list[list[dict]]]:
        rows: list[list[dict]] = [[] for _ in range(self.num_processes)]
        for sample in self.dataset:
            length = len(sample["input_ids"])
            if length > self.token_budget:
                self.metrics["batch/dropped_oversize_total"].append(1.0)
                continue
            fitting = [row for row in rows if sum(len(s["input_ids"]) for s in row) + length <= self.token_budget]
            if not fitting:  # every row holds something (an empty row always fits)
                yield rows
                rows = [[] for _ in range(self.num_processes)]
                fitting = rows
            min(fitting, key=_cost).append(sample)


def _pad_rows(rows: list[torch.Tensor], value: float) -> torch.Tensor:
    length = max(row.shape[0] for row in rows)
    out = torch.full((len(rows), length, *rows[0].shape[1:]), value, dtype=rows[0].dtype)
    for index, row in enumerate(rows):
        out[index, : row.shape[0]] = row
    return out


@dataclass
class DataCollatorForRollout:
    """Collates one planned micro-batch (rows of samples, dataloader batch size 1) into padding-free rows.

    Each row concatenates its samples: `input_ids`, `completion_mask`, `position_ids` (restarting at 0 for every
    sample), `teacher_topk_ids` (pad -1) and `teacher_topk_logprobs` (pad -inf), and with `teacher_id_to_idx`
    `teacher_id_idx` (the teacher of each token, pad -1); rows are right-padded to the longest and `attention_mask`
    marks real tokens. `global_n_tokens` (completion tokens of the micro-batch), `global_n_forward_tokens` and
    `mean_seq_len` are repeated once per process.

    Args:
        pad_token_id: Id used to pad `input_ids`.
        num_processes: Number of training processes (rows per micro-batch).
        teacher_id_to_idx: Teacher id -> index, or `None`; when given, `teacher_id_idx` is added (the trainer gives
            it with two or more teachers).
        return_tensors: Only `"pt"`.
        prompts_trained: Set the prompt ids of collated samples are added to.
        metrics: `defaultdict(list)` of batch metrics.
        token_budget: The planner's token budget (`> 0` adds `batch/row_fill_frac`).
    """

    pad_token_id: int
    num_processes: int = 1
    teacher_id_to_idx: dict[str, int] | None = None
    return_tensors: str = "pt"
    prompts_trained: set[int] = field(default_factory=set)
    metrics: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    token_budget: int = 0

    def __call__(self, examples: list[list[list[dict]]]) -> dict[str, torch.Tensor]:
        return self.torch_call(examples)

    def torch_call(self, examples: list[list[list[dict]]]) -> dict[str, torch.Tensor]:
        rows = [row for micro_batch in examples for row in micro_batch]
        several = self.teacher_id_to_idx is not None
        keys = {"input_ids": [], "completion_mask": [], "position_ids": [], "ids": [], "lps": [], "teacher": []}
        for row in rows:
            keys["input_ids"].append(torch.as_tensor(np.concatenate([s["input_ids"] for s in row])))
            keys["completion_mask"].append(torch.as_tensor(np.concatenate([s["completion_mask"] for s in row])))
            keys["position_ids"].append(torch.cat([torch.arange(len(s["input_ids"])) for s in row]))
            keys["ids"].append(torch.as_tensor(np.concatenate([s["teacher_topk_ids"] for s in row])))
            keys["lps"].append(torch.as_tensor(np.concatenate([s["teacher_topk_logprobs"] for s in row])))
            if several:
                index = [self.teacher_id_to_idx[s["teacher_id"]] for s in row]
                keys["teacher"].append(torch.cat([torch.full((len(s["input_ids"]),), i) for s, i in zip(row, index)]))
        batch = {
            "input_ids": _pad_rows(keys["input_ids"], self.pad_token_id).long(),
            "attention_mask": _pad_rows([torch.ones_like(t) for t in keys["input_ids"]], 0).long(),
            "completion_mask": _pad_rows(keys["completion_mask"], 0).long(),
            "position_ids": _pad_rows(keys["position_ids"], 0).long(),
            "teacher_topk_ids": _pad_rows(keys["ids"], -1).long(),
            "teacher_topk_logprobs": _pad_rows(keys["lps"], float("-inf")).float(),
        }
        if several:
            batch["teacher_id_idx"] = _pad_rows(keys["teacher"], -1).long()
        samples = [sample for row in rows for sample in row]
        trained = sum(int(np.sum(s["completion_mask"])) for s in samples)
        forwarded = sum(len(s["input_ids"]) for s in samples)
        repeat = (self.num_processes,)
        batch["global_n_tokens"] = torch.full(repeat, float(trained), dtype=torch.float32)
        batch["global_n_forward_tokens"] = torch.full(repeat, float(forwarded), dtype=torch.float32)
        batch["mean_seq_len"] = torch.full(repeat, forwarded / max(len(samples), 1), dtype=torch.float32)
        for sample in samples:
            self.prompts_trained.add(int(sample["prompt_id"]))
        self._log_metrics(rows, samples, batch["input_ids"].shape[1])
        return batch

    def _log_metrics(self, rows: list[list[dict]], samples: list[dict], padded_len: int) -> None:
        row_tokens = [sum(len(s["input_ids"]) for s in row) for row in rows]
        log_sample_and_row_metrics(self.metrics, samples, row_tokens, [_cost(row) for row in rows])
        total = sum(row_tokens)
        if self.token_budget > 0:
            self.metrics["batch/row_fill_frac"].append((total, self.token_budget * len(rows)))
        self.metrics["batch/pad_frac"].append((padded_len * len(rows) - total, padded_len * len(rows)))


def distillation_support(
    topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, targets: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The support of each position from the teacher's candidates `(N, K)` for the realised `targets` `(N,)`.

    `beta == 0`: every valid candidate. Otherwise `{top-1 candidate, realised token}` (its teacher log-prob read from
    the candidates; the second slot invalid when both are the same token), the realised token alone at `beta == 1`.

    Returns:
        `(ids, teacher_log_probs, valid)`, each `(N, S)`.
    """
    valid = (topk_ids >= 0) & torch.isfinite(topk_logprobs)
    if beta == 0.0:
        return topk_ids.clamp(min=0), topk_logprobs, valid
    matches = (topk_ids == targets[:, None]) & valid
    realised = torch.where(matches, topk_logprobs, torch.full_like(topk_logprobs, float("-inf"))).max(dim=-1).values
    realised_ok = matches.any(dim=-1)
    if beta == 1.0:
        return targets[:, None], realised[:, None], realised_ok[:, None]
    ids = torch.stack([topk_ids[:, 0].clamp(min=0), targets], dim=-1)
    lps = torch.stack([topk_logprobs[:, 0], realised], dim=-1)
    ok = torch.stack([valid[:, 0], realised_ok & (targets != topk_ids[:, 0])], dim=-1)
    return ids, lps, ok


class AsyncDistillationTrainer(AsyncGRPOTrainer):
    """On-policy distillation with generation beside training (TRL 1.16's `AsyncDistillationTrainer`).

    The student samples one completion per prompt through its vLLM server; the prompt's teacher server scores it
    (top-k log-probabilities at every completion token); the trainer drops samples more than `max_staleness` policy
    versions old, packs the others into padding-free rows and minimises the sparse-support divergence between the
    student (logits divided by `teacher_temperature`) and the teacher, summed over positions and support and divided
    by the micro-batch's completion tokens; weights are pushed to the student's server every `weight_sync_steps`.

    Args:
        model: Model id or path (loaded by the trainer).
        args: [`AsyncDistillationConfig`] (default: `AsyncDistillationConfig(f"{model_name}-AsyncDistillation")`).
        train_dataset: Rows with a `prompt` (conversational) and, with several teachers, a `teacher_id`.
        processing_class: Tokenizer shared by student and teachers (default: loaded from `model`).
        callbacks: Extra callbacks.
        optimizers: `(optimizer, scheduler)`.
        peft_config: PEFT config (never on `lm_head`); synced adapter-only or merged, as in AsyncGRPO.
        rollout_worker: A [`RolloutWorkerProtocol`] replacing the default [`AsyncRolloutWorker`].
        weight_transfer: A [`WeightTransferProtocol`] replacing the default transfer to `trl vllm-serve`.
    """

    _tag_names = ["trl", "async-distillation"]
    _name = "AsyncDistillation"
    _queue_dataset_class = RolloutQueueDataset
    _group_key = "prompt_id"
    _trained_ids_attribute = "prompts_trained"
    _logs_groups_per_step = False
    # Positions whose logits go through the LM head at once.
    _head_chunk_size = 256

    def __init__(
        self,
        model: str,
        args: AsyncDistillationConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        rollout_worker: RolloutWorkerProtocol | None = None,
        weight_transfer: WeightTransferProtocol | None = None,
    ):
        if not isinstance(model, str):
            raise ValueError(
                f"AsyncDistillationTrainer loads the model itself: pass its id or path, got {type(model)}."
            )
        if args is None:
            args = AsyncDistillationConfig(f"{model.split('/')[-1]}-AsyncDistillation")
        self._check_async_inputs(args, train_dataset)
        urls = args.teacher_server_urls
        self.teacher_server_urls = {"default": urls} if isinstance(urls, str) else dict(urls)
        if len(self.teacher_server_urls) > 1:
            unknown = set(train_dataset["teacher_id"] if "teacher_id" in train_dataset.column_names else [None])
            unknown -= set(self.teacher_server_urls)
            if unknown:
                raise ValueError(
                    f"With several teachers ({sorted(self.teacher_server_urls)}), every row needs a `teacher_id` "
                    f"column naming one of them; found {sorted(map(str, unknown))}."
                )
        from ...models.loading import create_model_from_path

        policy = create_model_from_path(model, device_map=None, **_load_init_kwargs(args))
        if not (packed_sdpa_applicable(policy) or packed_attention_kind(policy) == "varlen"):
            raise ValueError(
                f"AsyncDistillation packs several sequences per row, which needs SDPA or a variable-length attention "
                f"kernel (FlashAttention); {model} attends with "
                f"{getattr(policy.config, '_attn_implementation', None)!r}. Load it with "
                "model_init_kwargs={'attn_implementation': 'sdpa'}."
            )
        self._aux_loss_enabled = False
        policy = self._wrap_peft(policy, peft_config, args)
        processing_class = self._load_tokenizer(model, processing_class, args)
        # Rank 0 connects now: an unreachable teacher fails before training, on every rank.
        from accelerate import PartialState

        self._teacher_clients = rank0_call(
            lambda: self._build_teacher_clients(args) if rollout_worker is None else None,
            PartialState().is_main_process,
            broadcast_result=False,
        )
        self._setup_async(
            policy, args, train_dataset, processing_class, callbacks, optimizers, rollout_worker, weight_transfer, 1
        )

    def _build_teacher_clients(self, args: AsyncDistillationConfig) -> dict[str, Any]:
        """One scoring client per teacher server (`trl vllm-serve` or a plain `vllm serve`)."""
        from ...generation.vllm_client import VLLMClient as ScoringClient

        return {
            teacher: ScoringClient(base_url=url, connection_timeout=args.vllm_server_timeout)
            for teacher, url in self.teacher_server_urls.items()
        }

    def _build_collator(self, processing_class: Any, num_processes: int, token_budget: int) -> DataCollatorForRollout:
        return DataCollatorForRollout(
            pad_token_id=processing_class.pad_token_id,
            num_processes=num_processes,
            teacher_id_to_idx={teacher: i for i, teacher in enumerate(self.teacher_server_urls)}
            if len(self.teacher_server_urls) > 1
            else None,
            metrics=self._metrics,
            token_budget=token_budget,
        )

    def _build_planner(self, dataset: IterableDataset, num_processes: int) -> IterableDataset:
        if self._token_budget > 0:
            return TokenBudgetBatcher(dataset, num_processes, self._token_budget, self._metrics)
        return FixedCountBatcher(dataset, num_processes, self.args.per_device_train_batch_size * num_processes)

    def _build_rollout_worker(self) -> AsyncRolloutWorker:
        args = self._args_for_worker
        if self._teacher_clients is None:
            self._teacher_clients = self._build_teacher_clients(args)
        return AsyncRolloutWorker(
            queue_maxsize=args.queue_maxsize,
            backend=self._generation_backend,
            dataset=self._prompt_dataset,
            dataset_start_index=self._dataset_start_index,
            tokenizer=self._tokenizer,
            teacher_clients=self._teacher_clients,
            teacher_top_k=args.teacher_top_k,
            teacher_temperature=args.teacher_temperature,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            model_name=getattr(self.model.config, "_name_or_path", ""),
            chat_template_kwargs=args.chat_template_kwargs,
            backend_timeout=args.vllm_server_timeout,
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        # Forward and backward (its recomputation of checkpointed layers included) with the per-sequence attention.
        with packed_sdpa_attention(model):
            return super().training_step(model, inputs, num_items_in_batch)

    # -- loss --------------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        import time

        start = time.perf_counter()
        length = int(inputs["attention_mask"][0].sum())
        input_ids = inputs["input_ids"][:, :length]
        position_ids = inputs["position_ids"][:, :length]
        # Padding-free: each packed sequence attends only to itself (per-sequence SDPA, or a varlen kernel).
        with packed_sdpa_attention(model):
            outputs = model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **sequence_boundaries(position_ids)
            )
        logits = outputs.logits[0]
        # Position j predicts token j + 1 with the teacher candidates recorded at j + 1 (never across samples: a
        # completion token always follows a token of its own sequence).
        targets = input_ids[0, 1:]
        topk_ids = inputs["teacher_topk_ids"][0, 1:length]
        topk_lps = inputs["teacher_topk_logprobs"][0, 1:length]
        trained = inputs["completion_mask"][0, 1:length].bool()
        ids, teacher, valid = distillation_support(topk_ids, topk_lps, targets, self.args.beta)
        use = trained & valid.any(dim=-1)
        positions = use.nonzero().squeeze(-1)
        per_position, entropy, teacher_entropy = [], [], []
        for chunk in positions.split(self._head_chunk_size):
            student = (logits[chunk].float() / self.args.teacher_temperature).log_softmax(dim=-1)
            per_position.append(
                sparse_support_divergence(
                    student, ids[chunk], teacher[chunk], valid[chunk], self.args.beta, self.args.add_tail_bucket
                )
            )
            with torch.no_grad():
                entropy.append(-(student.exp() * student).sum(dim=-1))
                teacher_entropy.append(_support_entropy(teacher[chunk], valid[chunk], self.args.add_tail_bucket))
        num_tokens = float(inputs["global_n_tokens"][0]) / self.accelerator.num_processes
        if per_position:
            divergence = torch.cat(per_position)
            loss = divergence.sum() / max(num_tokens, 1.0)
        else:  # nothing to learn from: a zero that still reaches every parameter
            divergence = logits.new_zeros(0)
            loss = logits.sum() * 0.0
        self._record_divergence_metrics(divergence, entropy, teacher_entropy, inputs, positions)
        self._step["perf/fwd_s"] += time.perf_counter() - start
        self._step["batch/microbatches_per_step"] += 1
        self._step["batch/forwarded_tokens_per_step"] += float(inputs["global_n_forward_tokens"][0])
        self._step["batch/trained_tokens_per_step"] += float(inputs["global_n_tokens"][0])
        return (loss, outputs) if return_outputs else loss

    def _record_divergence_metrics(
        self, divergence: torch.Tensor, entropy: list, teacher_entropy: list, inputs: dict, positions: torch.Tensor
    ) -> None:
        nan = float("nan")
        divergence = divergence.detach()
        entropy_t = torch.cat(entropy) if entropy else divergence.new_zeros(0)
        teacher_t = torch.cat(teacher_entropy) if teacher_entropy else divergence.new_zeros(0)
        self._metrics["jsd"].append(float(divergence.mean()) if divergence.numel() else nan)
        self._metrics["entropy"].append(float(entropy_t.mean()) if entropy_t.numel() else nan)
        self._metrics["teacher_entropy"].append(float(teacher_t.mean()) if teacher_t.numel() else nan)
        if "teacher_id_idx" not in inputs:
            return
        owners = inputs["teacher_id_idx"][0, 1:][positions]
        for index, teacher in enumerate(self.teacher_server_urls):
            mine = owners == index
            count = int(mine.sum())
            self._metrics[f"teacher_token_frac/{teacher}"].append((count, max(int(positions.numel()), 1)))
            self._metrics[f"teacher_jsd/{teacher}"].append(float(divergence[mine].mean()) if count else nan)
            self._metrics[f"teacher_entropy/{teacher}"].append(float(teacher_t[mine].mean()) if count else nan)


def _support_entropy(teacher: torch.Tensor, valid: torch.Tensor, add_tail: bool) -> torch.Tensor:
    """Entropy of the teacher's distribution on its sparse support (with the tail bucket, or renormalised)."""
    masked = teacher.masked_fill(~valid, float("-inf"))
    if add_tail:
        log_p = add_tail_bucket(masked, valid)
        valid = torch.cat([valid, torch.ones_like(valid[..., :1])], dim=-1)
    else:
        log_p = renormalize_on_support(masked, valid)
    terms = torch.where(valid, -log_p.exp() * log_p, torch.zeros_like(log_p))
    return torch.nan_to_num(terms, nan=0.0).sum(dim=-1)

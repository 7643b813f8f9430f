"""Asynchronous GRPO: the trainer side (rank 0 reads the rollout queue, plans packed micro-batches, trains, syncs).

This module holds the protocols a custom rollout worker or weight transfer implements, the loss, the step callback,
and re-exports the planning, collation and LoRA-sync helpers under TRL's import path.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import queue
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn
from accelerate import PartialState
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoTokenizer, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ...models.loading import create_model_from_path
from ...trainer.online_rewards import _OnlineRewardsMixin, reward_signature_problem
from ...trainer.tool_calling import environment_reward_classes
from ...trainer.utils import prepare_peft_model
from ._backends import (
    GenerationBackend,
    OpenAICompletionsBackend,
    PauseResumeTransfer,
    VLLMServeBackend,
    VLLMServeWeightTransfer,
    is_plain_vllm_server,
)
from ._batching import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
    _EmptyIterableDataset,
    _reduce_metric,
    log_rollout_traces,
)
from ._conversation import prepare_tool_setup, prepare_tool_tokenizer
from ._lora_sync import (
    VLLM_LORA_RANKS,
    _iter_vllm_named_params,
    load_policy_adapter,
    policy_adapter_dir,
    probe_adapter_sync,
    retire_policy_adapters,
    round_lora_rank,
    save_lora_adapter,
    select_adapter_sync,
    validate_lora_for_vllm_sync,
)
from ._ranks import RelayFailures, collate_or_relay, raise_relayed_failure, rank0_call
from .async_grpo_config import AsyncGRPOConfig
from .async_rollout_worker import AsyncRolloutWorker
from .packing import TREE_ATTENTION, TreeRow, register_tree_attention


# Written next to each checkpoint: where the rollouts resume and the policy version.
ROLLOUT_STATE_NAME = "rollout_state.json"

logger = logging.getLogger(__name__)

__all__ = [
    "TREE_ATTENTION",
    "VLLM_LORA_RANKS",
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "DataCollatorForRollout",
    "FixedCountBatcher",
    "RolloutQueueDataset",
    "RolloutWorkerProtocol",
    "StepIntervalCallback",
    "TokenBudgetBatcher",
    "TreeRow",
    "WeightTransferProtocol",
    "_EmptyIterableDataset",
    "_iter_vllm_named_params",
    "_reduce_metric",
    "clipped_surrogate_loss",
    "log_rollout_traces",
    "register_tree_attention",
    "round_lora_rank",
    "save_lora_adapter",
    "select_adapter_sync",
    "validate_lora_for_vllm_sync",
]


@runtime_checkable
class RolloutWorkerProtocol(Protocol):
    """What the trainer needs from a rollout worker (inject one with `rollout_worker=`)."""

    rollout_buffer: Any
    metrics_queue: Any

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def update_model_version(self, model_version: int) -> None: ...

    def check_health(self, stale_after_s: float) -> None: ...


@runtime_checkable
class WeightTransferProtocol(Protocol):
    """What the trainer needs to push weights to the generation server (inject one with `weight_transfer=`)."""

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None: ...

    def resume(self) -> None: ...

    def destroy(self) -> None: ...


class StepIntervalCallback(TrainerCallback):
    """Calls `fn()` at the end of every `every_n_steps`-th optimizer step."""

    def __init__(self, fn: Callable[[], None], every_n_steps: int):
        self.fn = fn
        self.every_n_steps = every_n_steps

    def on_step_end(self, args, state, control, **kwargs):
        if self.every_n_steps > 0 and state.global_step % self.every_n_steps == 0:
            self.fn()
        return control


def clipped_surrogate_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    num_tokens: float,
    epsilon_low: float,
    epsilon_high: float,
    gradient_accumulation_steps: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AsyncGRPO's loss over the trained tokens of a micro-batch (one entry per token, flattened).

    With `ρ = exp(log π_θ − log π_old)` (π_old the sampler's log-probabilities), each token contributes
    `ℓ = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)`; the loss is `Σℓ / max(num_tokens, 1) / GA`, `num_tokens` being
    the trained tokens of the micro-batch per process. There is no KL term and no reference model.

    Returns:
        `(loss, stats)` where stats (detached, per-token means) are `ratio`, `kl` (`ρ − 1 − log ρ`, a divergence from
        the sampler), `clip_ratio/low_mean` (ρ below the range with A < 0), `clip_ratio/high_mean` (above, A > 0) and
        `clip_ratio/region_mean` (either).
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    loss = per_token.sum() / max(float(num_tokens), 1.0) / gradient_accumulation_steps
    with torch.no_grad():
        low = (ratio < 1.0 - epsilon_low) & (advantages < 0)
        high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
        stats = {
            "ratio": ratio.mean(),
            "kl": (ratio - 1.0 - log_ratio).mean(),
            "clip_ratio/low_mean": low.float().mean(),
            "clip_ratio/high_mean": high.float().mean(),
            "clip_ratio/region_mean": (low | high).float().mean(),
        }
    return loss, stats


def _load_init_kwargs(args: AsyncGRPOConfig) -> dict[str, Any]:
    kwargs = args.model_init_kwargs or {}
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    kwargs = dict(kwargs)
    kwargs.setdefault("dtype", args.dtype)
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


def _check_worker_takes_lora_name(worker: Any) -> None:
    """Adapter-only sync tells the worker which adapter to generate with: `update_model_version(v, lora_name=...)`."""
    parameters = inspect.signature(worker.update_model_version).parameters
    if "lora_name" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise ValueError(
            f"The server loads LoRA adapters, so weight syncs push only the adapter and the rollout worker must "
            f"generate with it: {type(worker).__name__}.update_model_version needs a `lora_name` keyword (the "
            "adapter's name on the server), as AsyncRolloutWorker's has."
        )


def _check_model(model: nn.Module, args: AsyncGRPOConfig) -> bool:
    """Refuse what the tree-packed forward cannot train; returns whether the MoE aux loss is enabled."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text_config, "layer_types", None) or []
    other = sorted({kind for kind in layer_types if "attention" not in str(kind)})
    if other:
        raise ValueError(f"AsyncGRPO packs samples as prefix trees, which needs attention layers only; got {other}.")
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        raise ValueError("AsyncGRPO's tree attention does not support attention sinks (parameters named `*.sinks`).")
    is_moe = hasattr(text_config, "output_router_logits")
    if args.router_aux_loss_coef is not None and not is_moe:
        raise ValueError("`router_aux_loss_coef` is set but the model is not a mixture-of-experts model.")
    coef = args.router_aux_loss_coef
    if coef is None:
        coef = getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0
    return bool(is_moe and coef != 0)


class _TrainBeginCallback(TrainerCallback):
    """At train begin: open the weight transfer, push the initial weights (version 1), start the rollout worker."""

    def __init__(self, trainer: AsyncGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._start_rollouts()
        return control


class _StepMetricsCallback(TrainerCallback):
    """Times the optimizer step and the whole step, flushes the per-step counters, stops after the epoch budget."""

    def __init__(self, trainer: AsyncGRPOTrainer):
        self.trainer = trainer
        self._step_start = self._optimizer_start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._optimizer_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._step["perf/optimizer_s"] += time.perf_counter() - self._optimizer_start

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._flush_step(time.perf_counter() - self._step_start)
        trainer = self.trainer
        if trainer._target_groups is None:
            return control
        # Only rank 0 collates, so only its collator knows the groups trained (on every rank): it decides for all.
        trained = getattr(trainer.data_collator, trainer._trained_ids_attribute)
        if rank0_call(lambda: len(trained) >= trainer._target_groups, trainer._is_rollout_owner):
            control.should_training_stop = True
            control.should_save = args.save_strategy == "steps"
        return control


class AsyncGRPOTrainer(Trainer):
    """GRPO with generation running beside training (TRL 1.16's `AsyncGRPOTrainer`).

    A rollout worker samples completions through a generation server, scores them and queues the groups with the
    policy version they were sampled at; the trainer drops samples more than `max_staleness` versions old, packs the
    others into prefix-tree rows under `token_budget`, optimizes the clipped surrogate against the sampler's
    log-probabilities and pushes the new weights (version + 1) to the server every `weight_sync_steps` steps.

    Args:
        model: Model id or path (AsyncGRPO loads it itself, with the tree attention).
        reward_funcs: Reward function(s) or reward model id(s); their values are summed.
        args: [`AsyncGRPOConfig`] (default: `AsyncGRPOConfig(f"{model_name}-AsyncGRPO")`).
        train_dataset: Rows with a `prompt` column (plus columns passed to the reward functions, and an `environment`
            column with a dict `environment_factory`). Optional with a single `environment_factory` and `max_steps >
            0`: every prompt is then an empty user message that `reset()` fills in.
        processing_class: Tokenizer (default: loaded from `model`).
        callbacks: Extra callbacks.
        optimizers: `(optimizer, scheduler)`.
        peft_config: PEFT config. Weight syncs push only the adapter when the server loads LoRA adapters at runtime
            and [`select_adapter_sync`] accepts it, else the merged weights.
        tools: Functions the model may call (sync or async, with type hints and a Google-style docstring); rollouts
            become multi-turn conversations, tool results are untrained context.
        environment_factory: A callable returning an environment (a class with `reset(**row)`; its public methods
            become tools, a `get_reward()` adds a reward column named after the class), or a dict name → callable
            with rows naming theirs in an `environment` column. Instances are pooled and reused.
        rollout_worker: A [`RolloutWorkerProtocol`] replacing the default [`AsyncRolloutWorker`].
        weight_transfer: A [`WeightTransferProtocol`] replacing the default transfer to `trl vllm-serve`.
    """

    _tag_names = ["trl", "async-grpo"]
    _name = "AsyncGRPO"
    # Hooks shared with AsyncDistillation: the queue reader, the sample key identifying a prompt, the collator's set
    # of trained prompt ids, and whether `batch/groups_per_step` is logged.
    _queue_dataset_class = RolloutQueueDataset
    _group_key = "group_id"
    _trained_ids_attribute = "groups_trained"
    _logs_groups_per_step = True
    # Seconds of one blocking read of the rollout queue (the worker's health is checked after each empty read).
    _poll_interval_s = 5.0

    def __init__(
        self,
        model: str,
        reward_funcs=None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools: list[Callable] | None = None,
        environment_factory: Callable | dict[str, Callable] | None = None,
        rollout_worker: RolloutWorkerProtocol | None = None,
        weight_transfer: WeightTransferProtocol | None = None,
    ):
        if not isinstance(model, str):
            raise ValueError(f"AsyncGRPOTrainer loads the model itself: pass its id or path, got {type(model)}.")
        if args is None:
            args = AsyncGRPOConfig(f"{model.split('/')[-1]}-AsyncGRPO")
        self.tools, self._environment_pool, train_dataset = prepare_tool_setup(
            tools, environment_factory, args, train_dataset
        )
        self._check_async_inputs(args, train_dataset)

        register_tree_attention()
        policy = create_model_from_path(
            model, device_map=None, attn_implementation=TREE_ATTENTION, **_load_init_kwargs(args)
        )
        self._aux_loss_enabled = _check_model(policy, args)
        policy = self._wrap_peft(policy, peft_config, args)
        processing_class = self._load_tokenizer(model, processing_class, args)
        if self.tools or self._environment_pool is not None:
            prepare_tool_tokenizer(processing_class)

        if (
            not reward_funcs
            and self._environment_pool is not None
            and environment_reward_classes(self._environment_pool)
        ):
            # The environments' `get_reward` columns are rewards enough.
            self.reward_funcs, self.reward_processing_classes, self.reward_func_names = [], [], []
        else:
            self.reward_funcs, self.reward_processing_classes, self.reward_func_names = (
                _OnlineRewardsMixin._prepare_reward_funcs(self, reward_funcs, None, args)
            )
        keywords = ["prompts", "completions", "completion_ids"]
        keywords += [column for column in train_dataset.column_names if column not in ("prompt", "completion")]
        for func, name in zip(self.reward_funcs, self.reward_func_names, strict=True):
            problem = None if isinstance(func, nn.Module) else reward_signature_problem(func, keywords)
            if problem is not None:
                raise TypeError(
                    f"Reward function {name!r} cannot be called as the rollout worker calls it: {problem}."
                )
        turns = (args.max_tool_calling_iterations + 1) if args.max_tool_calling_iterations is not None else 32
        self._setup_async(
            policy,
            args,
            train_dataset,
            processing_class,
            callbacks,
            optimizers,
            rollout_worker,
            weight_transfer,
            samples_per_prompt=args.num_generations * turns,
        )

    def _setup_async(
        self,
        policy: nn.Module,
        args: Any,
        train_dataset: Any,
        processing_class: Any,
        callbacks: Any,
        optimizers: Any,
        rollout_worker: Any,
        weight_transfer: Any,
        samples_per_prompt: int,
    ) -> None:
        """What every asynchronous trainer sets up once its model and rollout inputs are ready: the epoch stop and
        step ceiling, the worker/transfer/server connection on rank 0, the token budget, the collator, the Trainer and
        the rollout callbacks. `samples_per_prompt` inflates the `max_steps` ceiling (rows one prompt may yield)."""
        num_processes = max(PartialState().num_processes, 1)
        samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * num_processes
        self._target_groups = None
        if args.max_steps <= 0:
            self._target_groups = math.ceil(args.num_train_epochs * len(train_dataset))
            args.max_steps = math.ceil(self._target_groups * samples_per_prompt / samples_per_step)
        if args.max_inflight_tasks < 0:
            args.max_inflight_tasks = max(args.max_staleness, 1) * samples_per_step

        self.model_version = 0
        self._metrics: dict[str, list] = defaultdict(list)
        self._step: dict[str, float] = defaultdict(float)
        self._step_groups: set[int] = set()
        self._prompt_dataset = train_dataset
        self._dataset_start_index = 0
        self._stopped = False
        self._adapter_sync = False
        self._lora_client = None
        self.vllm_client = None
        self._args_for_worker = args
        self._tokenizer = processing_class
        # Rank 0 owns the server connection, the transfer and the worker. The default backend and transfer connect
        # to the server here: an unreachable server fails before training. Each `rank0_call` runs on rank 0 and
        # raises its error on every rank, so that none waits for it in a collective; every rank takes part whatever
        # it was handed (only rank 0's arguments decide).
        self._is_rollout_owner = owner = PartialState().is_main_process
        self._failure_relay = None
        self._generation_backend = rank0_call(
            lambda: self._build_generation_backend() if rollout_worker is None else None, owner, broadcast_result=False
        )
        self._adapter_sync = self._decide_adapter_sync(policy, args, injected_transfer=weight_transfer is not None)
        weight_transfer = rank0_call(
            lambda: self._build_weight_transfer(policy, args) if weight_transfer is None else weight_transfer,
            owner,
            broadcast_result=False,
        )
        # What the other ranks were given is ignored: rank 0 alone pushes weights and runs the worker.
        self.weight_transfer = weight_transfer if owner else None
        self.rollout_worker = rollout_worker if owner else None
        if self._adapter_sync:
            rank0_call(
                lambda: self.rollout_worker and _check_worker_takes_lora_name(self.rollout_worker), owner, False
            )
        self.rollout_queue = self.rollout_worker.rollout_buffer if self.rollout_worker is not None else None

        token_budget = args.token_budget
        if token_budget is None:  # asked of rank 0's server, and broadcast so that every rank holds the same budget
            token_budget = rank0_call(self._server_max_model_len, owner)
        self._token_budget = token_budget
        collator = self._build_collator(processing_class, num_processes, max(token_budget, 0))
        Trainer.__init__(
            self,
            model=policy,
            args=args,
            data_collator=collator,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.model_accepts_loss_kwargs = False  # the Trainer divides the loss by the accumulation steps
        self.add_callback(_TrainBeginCallback(self))
        self.add_callback(StepIntervalCallback(self._sync_weight, args.weight_sync_steps))
        self.add_callback(_StepMetricsCallback(self))

    def _check_async_inputs(self, args: Any, train_dataset: Any) -> None:
        """Checks shared by the asynchronous trainers, before anything is loaded."""
        trainer = type(self).__name__
        if args.use_liger_kernel:
            raise NotImplementedError(f"{trainer} does not support `use_liger_kernel`.")
        if train_dataset is None or "prompt" not in (train_dataset.column_names or []):
            raise ValueError(f"{trainer} needs a `train_dataset` with a `prompt` column.")
        if not args.ignore_data_skip:
            warnings.warn(f"{self._name} restores its rollout position itself; `ignore_data_skip` is forced to True.")
            args.ignore_data_skip = True

    def _wrap_peft(self, policy: nn.Module, peft_config: Any, args: Any) -> nn.Module:
        """The policy with its PEFT adapter (never on `lm_head`: the synced weights would miss it)."""
        if peft_config is None:
            return policy
        targets = getattr(peft_config, "target_modules", None) or []
        if "lm_head" in (targets if isinstance(targets, (list, set, tuple)) else [targets]):
            raise ValueError(f"{self._name} does not train a PEFT adapter on `lm_head`.")
        return prepare_peft_model(policy, peft_config, args)

    @staticmethod
    def _load_tokenizer(model: str, processing_class: Any, args: Any) -> Any:
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model, trust_remote_code=args.trust_remote_code)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        return processing_class

    def _build_collator(self, processing_class: Any, num_processes: int, token_budget: int) -> Any:
        return DataCollatorForRollout(
            pad_token_id=processing_class.pad_token_id,
            num_processes=num_processes,
            metrics=self._metrics,
            token_budget=token_budget,
        )

    # -- setup helpers -----------------------------------------------------------------------------------------------

    def _get_vllm_client(self):
        """The `trl vllm-serve` client; a clear `ConnectionError` before training when the server is unreachable."""
        if self.vllm_client is None:
            from ...generation.vllm_client import VLLMClient

            args = self._args_for_worker
            self.vllm_client = VLLMClient(
                base_url=args.vllm_server_base_url, connection_timeout=args.vllm_server_timeout
            )
        return self.vllm_client

    def _plain_vllm_server(self) -> bool:
        """Whether the student's server is a plain `vllm serve` (TRL's setup) rather than `trl vllm-serve`."""
        if getattr(self, "_is_plain_vllm", None) is None:
            self._is_plain_vllm = is_plain_vllm_server(self._args_for_worker.vllm_server_base_url)
        return self._is_plain_vllm

    def _build_generation_backend(self) -> GenerationBackend:
        """The backend the default rollout worker generates with (override to use another one): `/v1/completions` of
        a plain `vllm serve`, or `trl vllm-serve`'s endpoints."""
        args = self._args_for_worker
        if self._plain_vllm_server():
            return OpenAICompletionsBackend(args.vllm_server_base_url, request_timeout=args.request_timeout)
        return VLLMServeBackend(self._get_vllm_client())

    def _build_weight_transfer(self, policy: nn.Module, args: Any) -> WeightTransferProtocol:
        """The default weight transfer: vLLM's NCCL engine for a plain `vllm serve` (GPU; only pause/resume with
        adapter-only sync), else `trl vllm-serve`'s weight-sync group."""
        if not self._plain_vllm_server():
            return VLLMServeWeightTransfer(self._get_vllm_client())
        from .vllm_client import VLLMClient as ServeClient
        from .weight_transfer import WeightTransferClient

        if self._adapter_sync:  # adapters are loaded by name: only pause/resume, no NCCL engine
            return PauseResumeTransfer(ServeClient(args.vllm_server_base_url, server_timeout=args.vllm_server_timeout))
        names, dtypes, shapes = [], [], []
        for name, parameter in _iter_vllm_named_params(policy):
            names.append(name)
            dtypes.append(str(parameter.dtype).replace("torch.", ""))
            shapes.append(list(parameter.shape))
        client = ServeClient(args.vllm_server_base_url, server_timeout=args.vllm_server_timeout)
        return WeightTransferClient(
            client, {"names": names, "dtype_names": dtypes, "shapes": shapes}, args.weight_sync_timeout
        )

    def _build_lora_client(self) -> Any:
        """The client loading adapters on the generation server (`get_server_info`, `load_lora_adapter`,
        `unload_lora_adapter`): `async_grpo.vllm_client.VLLMClient`, which speaks vLLM's LoRA routes of both
        `trl vllm-serve` and a plain `vllm serve`. Override to sync adapters into another server."""
        from .vllm_client import VLLMClient as ServeClient

        args = self._args_for_worker
        return ServeClient(args.vllm_server_base_url, server_timeout=args.vllm_server_timeout)

    def _decide_adapter_sync(self, policy: nn.Module, args: Any, injected_transfer: bool) -> bool:
        """Whether weight syncs push only the LoRA adapter, decided on rank 0 and broadcast (§ `select_adapter_sync`).

        A plain model or an injected `weight_transfer` (it owns the weight path)
        always sync merged weights. A probe error is raised on every rank."""
        if not hasattr(policy, "peft_config"):
            return False

        def probe() -> bool:
            # Only rank 0 is handed the weight transfer: whether one was injected is its call.
            if injected_transfer and type(self)._build_lora_client is AsyncGRPOTrainer._build_lora_client:
                logger.info("A custom `weight_transfer` receives the merged weights of the PEFT policy at each sync.")
                return False
            self._lora_client = self._build_lora_client()
            return probe_adapter_sync(self._lora_client, policy, args)

        return bool(rank0_call(probe, self._is_rollout_owner))

    def _server_max_model_len(self) -> int:
        for source in (self._generation_backend, self.vllm_client):
            get = getattr(source, "get_max_model_len", None)
            if get is not None:
                return int(get())
        raise ValueError(
            "token_budget=None takes the server's max_model_len, which this server does not report; set "
            "`token_budget` (tokens per packed row) or `token_budget=0` (fixed count per micro-batch)."
        )

    def _build_rollout_worker(self) -> AsyncRolloutWorker:
        args = self._args_for_worker
        return AsyncRolloutWorker(
            queue_maxsize=args.queue_maxsize,
            backend=self._generation_backend,
            dataset=self._prompt_dataset,
            dataset_start_index=self._dataset_start_index,
            tokenizer=self._tokenizer,
            reward_funcs=self.reward_funcs,
            reward_func_names=self.reward_func_names,
            reward_processing_classes=self.reward_processing_classes,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            model_name=getattr(self.model.config, "_name_or_path", ""),
            chat_template_kwargs=args.chat_template_kwargs,
            fork_threshold_tokens=args.fork_threshold_tokens,
            backend_timeout=args.vllm_server_timeout,
            tools=self.tools,
            environment_factory=self._environment_pool,
            max_tool_calling_iterations=args.max_tool_calling_iterations,
            max_inflight_tasks=args.max_inflight_tasks,
        )

    def get_train_dataloader(self) -> DataLoader:
        if not self._is_rollout_owner:  # rank 0 dispatches every micro-batch
            loader = DataLoader(_EmptyIterableDataset(), batch_size=1, collate_fn=self.data_collator)
            return self.accelerator.prepare(loader)
        if self.rollout_worker is None:
            self.rollout_worker = self._build_rollout_worker()
            self.rollout_queue = self.rollout_worker.rollout_buffer
        args = self.args
        dataset = self._queue_dataset_class(
            self.rollout_queue,
            model_version_fn=lambda: self.model_version,
            check_health_fn=self.rollout_worker.check_health,
            stale_after_s=args.heartbeat_stale_after_s,
            metrics=self._metrics,
            max_staleness=args.max_staleness,
            poll_interval_s=self._poll_interval_s,
            report_to=args.report_to,
        )
        num_processes = self.accelerator.num_processes
        planner = self._build_planner(dataset, num_processes)
        planner = _TimedPlanner(planner, self._step, self._step_groups, self._group_key)
        collate_fn = self.data_collator
        if num_processes > 1:  # an error reading the queue is dispatched to every rank (one process: raised here)
            planner = self._failure_relay = RelayFailures(planner)
            collate_fn = collate_or_relay(self.data_collator, num_processes, planner)
        loader = DataLoader(planner, batch_size=1, collate_fn=collate_fn)
        return self.accelerator.prepare(loader)

    def _build_planner(self, dataset: IterableDataset, num_processes: int) -> IterableDataset:
        """Micro-batch planner over the queue's samples: by token budget, or a fixed count per micro-batch."""
        if self._token_budget > 0:
            return TokenBudgetBatcher(dataset, num_processes, self._token_budget, self._metrics)
        return FixedCountBatcher(dataset, num_processes, self.args.per_device_train_batch_size * num_processes)

    # -- rollouts and weight sync ------------------------------------------------------------------------------------

    def _start_rollouts(self) -> None:
        # Opening the transfer and starting the worker (its backend's readiness check) happen on rank 0 only; a
        # failure there is raised on every rank.
        owner = self._is_rollout_owner

        def init_transfer() -> None:
            if self.weight_transfer is not None and not self._adapter_sync:  # adapter-only sync opens no group
                self.weight_transfer.init_weight_transfer()

        def start() -> None:
            if self.rollout_worker is not None:
                self.rollout_worker.start()

        rank0_call(init_transfer, owner, broadcast_result=False)
        self._sync_weight()
        rank0_call(start, owner, broadcast_result=False)

    def _sync_weight(self) -> None:
        """Push the current policy and bump the policy version: merged full weights (PEFT merged for the push), or
        with adapter-only sync the adapter, saved by every rank and loaded by rank 0 as `trl-policy-v{N}`, after
        which the rollout worker generates with it and versions older than `max_staleness` are retired."""
        start = time.perf_counter()
        if self.weight_transfer is not None:
            self.weight_transfer.pause()
        paused = time.perf_counter()
        self.accelerator.wait_for_everyone()
        barrier = time.perf_counter()
        model = self.accelerator.unwrap_model(self.model)
        version = self.model_version + 1
        output_dir = self.args.output_dir
        if self._adapter_sync:
            save_lora_adapter(model, self.accelerator, model.active_adapter, policy_adapter_dir(output_dir, version))
        else:
            self._push_merged_weights(model)
        transferred = time.perf_counter()
        self.accelerator.wait_for_everyone()
        adapter = self._adapter_sync and self._is_rollout_owner
        lora_name = load_policy_adapter(self._lora_client, output_dir, version) if adapter else None
        if self.weight_transfer is not None:
            self.weight_transfer.resume()
        if adapter:
            retire_policy_adapters(self._lora_client, output_dir, version, self.args.max_staleness)
        self.model_version = version
        if self.rollout_worker is not None:
            if lora_name is None:
                self.rollout_worker.update_model_version(version)
            else:
                self.rollout_worker.update_model_version(version, lora_name=lora_name)
        self._log_sync_times(start, paused, barrier, transferred)

    def _push_merged_weights(self, model: nn.Module) -> None:
        """Stream `(vLLM name, tensor)` of the full weights (PEFT adapters merged for the push, unmerged after)."""
        is_peft = hasattr(model, "peft_config")
        try:
            if is_peft:
                model.merge_adapter()
            named = ((name, param.data) for name, param in _iter_vllm_named_params(model))
            if self.weight_transfer is not None:
                self.weight_transfer.send_weights(named)
            else:
                for _ in named:  # other ranks iterate too (the collectives of sharded parameters)
                    pass
        finally:
            if is_peft:
                model.unmerge_adapter()

    def _log_sync_times(self, start: float, paused: float, barrier: float, transferred: float) -> None:
        self._metrics["perf/weight_sync_s"].append(time.perf_counter() - start)
        self._metrics["perf/weight_sync_pause_s"].append(paused - start)
        self._metrics["perf/weight_sync_barrier_s"].append(barrier - paused)
        self._metrics["perf/weight_sync_transfer_s"].append(transferred - barrier)

    def _shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.rollout_worker is not None:
                self.rollout_worker.stop()
        finally:
            if self.weight_transfer is not None and not self._adapter_sync:
                self.weight_transfer.destroy()

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """Train; the rollout worker is stopped and the weight transfer closed however training ends."""
        if resume_from_checkpoint:
            self._restore_rollout_state(resume_from_checkpoint)
        self._stopped = False
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            self._shutdown()

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def _first_untrained_group(self) -> int:
        trained, group = getattr(self.data_collator, self._trained_ids_attribute), 0
        while group in trained:
            group += 1
        return group

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if not self.args.should_save:
            return
        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        state = {
            "prompt_index": self._dataset_start_index + self._first_untrained_group(),
            "model_version": self.model_version,
        }
        with open(os.path.join(folder, ROLLOUT_STATE_NAME), "w") as handle:
            json.dump(state, handle)

    def _restore_rollout_state(self, checkpoint: str | bool) -> None:
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        path = os.path.join(str(checkpoint), ROLLOUT_STATE_NAME)
        if not os.path.isfile(path):
            warnings.warn(f"No {ROLLOUT_STATE_NAME} in {checkpoint}; rollouts restart from the first prompt.")
            return
        with open(path) as handle:
            state = json.load(handle)
        self._dataset_start_index = int(state["prompt_index"])
        self.model_version = int(state["model_version"])

    # -- loss and metrics --------------------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        raise_relayed_failure(inputs, self._failure_relay)
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step["perf/fwd_bwd_s"] += time.perf_counter() - start
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = inputs["attention_mask"][0].bool()
        length = int(mask.sum())
        cu_q = inputs["tree_cu_seqlens_q"][0]
        cu_k = inputs["tree_cu_seqlens_k"][0]
        kv_index = inputs["tree_kv_index"][0]
        token_index = inputs["token_index"][0]
        trained = token_index >= 0
        token_index = token_index[trained]
        labels = inputs["shift_labels"][0, :length]
        forward_kwargs = {}
        if self._aux_loss_enabled:
            forward_kwargs["output_router_logits"] = True
        start = time.perf_counter()
        outputs = model(
            input_ids=inputs["input_ids"][:, :length],
            position_ids=inputs["position_ids"][:, :length],
            tree_kv_index=kv_index[kv_index >= 0],
            tree_cu_seqlens_q=cu_q[cu_q >= 0].to(torch.int32),
            tree_cu_seqlens_k=cu_k[cu_k >= 0].to(torch.int32),
            tree_max_seqlen_q=int(inputs["tree_max_seqlens"][0, 0]),
            tree_max_seqlen_k=int(inputs["tree_max_seqlens"][0, 1]),
            use_cache=False,
            **forward_kwargs,
        )
        logits = outputs.logits[0, token_index].float() / self.args.temperature
        all_log_probs = torch.log_softmax(logits, dim=-1)
        log_probs = all_log_probs.gather(-1, labels[token_index].unsqueeze(-1)).squeeze(-1)
        num_tokens = float(inputs["global_n_tokens"][0]) / self.accelerator.num_processes
        epsilon_high = self.args.epsilon_high if self.args.epsilon_high is not None else self.args.epsilon
        loss, stats = clipped_surrogate_loss(
            log_probs,
            inputs["old_log_probs"][0, trained],
            inputs["advantages"][0, trained],
            num_tokens,
            self.args.epsilon,
            epsilon_high,
        )
        if self._aux_loss_enabled and getattr(outputs, "aux_loss", None) is not None:
            coef = self.args.router_aux_loss_coef
            if coef is None:
                coef = self.model.config.get_text_config().router_aux_loss_coef
            loss = loss + coef * outputs.aux_loss
            self._metrics["aux_loss"].append(float(outputs.aux_loss))
        self._step["perf/fwd_s"] += time.perf_counter() - start
        with torch.no_grad():
            entropy = -(all_log_probs.exp() * all_log_probs).sum(-1)
            stats["entropy"] = entropy.mean() if entropy.numel() else torch.tensor(float("nan"))
            stats["clip_ratio/low_min"] = stats["clip_ratio/low_mean"]
            stats["clip_ratio/high_max"] = stats["clip_ratio/high_mean"]
        for key, value in stats.items():
            self._metrics[key].append(float(value))
        self._step["batch/microbatches_per_step"] += 1
        self._step["batch/forwarded_tokens_per_step"] += float(inputs["global_n_forward_tokens"][0])
        self._step["batch/trained_tokens_per_step"] += float(inputs["global_n_tokens"][0])
        return (loss, outputs) if return_outputs else loss

    def _flush_step(self, step_s: float) -> None:
        """Turn the step's counters into the per-step metrics."""
        step = self._step
        self._metrics["perf/step_s"].append(step_s)
        for key in (
            "perf/fwd_bwd_s", "perf/fwd_s", "perf/optimizer_s", "perf/rollout_wait_s", "batch/microbatches_per_step",
            "batch/forwarded_tokens_per_step", "batch/trained_tokens_per_step", "batch/samples_per_step",
        ):  # fmt: skip
            self._metrics[key].append(step[key])
        if self._logs_groups_per_step:
            self._metrics["batch/groups_per_step"].append(float(len(self._step_groups)))
        if step["perf/fwd_bwd_s"] > 0:
            self._metrics["perf/forwarded_tok_s_fwd_bwd"].append(
                step["batch/forwarded_tokens_per_step"] / step["perf/fwd_bwd_s"]
            )
        if step_s > 0:
            self._metrics["perf/forwarded_tok_s_wall_clock"].append(step["batch/forwarded_tokens_per_step"] / step_s)
            self._metrics["perf/trained_tok_s_wall_clock"].append(step["batch/trained_tokens_per_step"] / step_s)
        step.clear()
        self._step_groups.clear()

    def _drain_worker_metrics(self) -> None:
        if self.rollout_worker is None:
            return
        while True:
            try:
                metrics = self.rollout_worker.metrics_queue.get_nowait()
            except queue.Empty:
                return
            for key, value in metrics.items():
                self._metrics[key].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._drain_worker_metrics()
        for key, values in self._metrics.items():
            kept = [v for v in values if isinstance(v, tuple) or not math.isnan(v)]
            logs[key] = _reduce_metric(key, kept) if kept else None
        self._metrics.clear()
        super().log(logs, start_time)


class _TimedPlanner(IterableDataset):
    """Wraps the planner: records the time spent waiting for each micro-batch and the step's samples and groups."""

    def __init__(self, planner: IterableDataset, step: dict, groups: set, group_key: str = "group_id"):
        self.planner = planner
        self.step = step
        self.groups = groups
        self.group_key = group_key

    def __iter__(self):
        iterator = iter(self.planner)
        while True:
            start = time.perf_counter()
            try:
                rows = next(iterator)
            except StopIteration:
                return
            self.step["perf/rollout_wait_s"] += time.perf_counter() - start
            samples = [sample for row in rows for sample in getattr(row, "samples", row)]  # TreeRow or list
            self.step["batch/samples_per_step"] += len(samples)
            self.groups.update(int(sample[self.group_key]) for sample in samples)
            yield rows

"""The rollout worker: generation beside training, scoring, and the samples it hands to the trainer.

[`AsyncRolloutWorker`] runs the rollout loop on a background thread of the trainer process: it cycles over the
prompts, samples `num_generations` completions per prompt through a [`GenerationBackend`], scores the group with the
reward functions, computes the group-relative advantages and puts one [`RolloutSample`] per training row into the
bounded `rollout_buffer`, stamped with the policy version the group was opened at.

TRL 1.16 runs this loop in a spawned child process (one asyncio loop, concurrent conversations); this version runs it
on a thread with one group at a time, see `docs/async_grpo.md`.
"""

from __future__ import annotations

import inspect
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.nn as nn

from ...trainer.online_rewards import _OnlineRewardsMixin, _run_coroutines, _to_float_list
from ...trainer.utils import is_async_callable
from ._backends import GenerationBackend
from ._reconcile import DriftKind, TrainingSequence, TurnRecord, _chain_to_sequences, _common_prefix_len


logger = logging.getLogger(__name__)

__all__ = [
    "AsyncRolloutWorker",
    "DriftKind",
    "RolloutGroup",
    "RolloutSample",
    "TrainingSequence",
    "TurnRecord",
    "_chain_to_sequences",
    "_common_prefix_len",
]


@dataclass
class RolloutGroup:
    """The finished conversations of one prompt, waiting to be scored."""

    prompts: list[list[dict[str, str]]]
    reward_kwargs: dict[str, list[Any]]
    completions: list[list[dict[str, str]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0


@dataclass
class RolloutSample:
    """One training row handed to the trainer.

    `model_version` is the policy version when the sample's group was opened; `metrics` holds per-sample values
    (`reward`, `reward_std`, `rewards/<name>`, ...) averaged per micro-batch by the collator.
    """

    prompt: list[dict[str, str]]
    completion: list[dict[str, str]]
    input_ids: np.ndarray
    completion_mask: np.ndarray
    old_log_probs: np.ndarray
    advantage: float
    model_version: int
    group_id: int
    metrics: dict[str, float]
    enqueued_at: float | None = None


# Metrics sent per finished group; the trainer drains them in `log()`.
_METRICS_QUEUE_SIZE = 4096
_PUT_RETRY_S = 0.05
ADVANTAGE_EPS = 1e-8


def _render_prompt(tokenizer: Any, prompt: Any, chat_template_kwargs: dict | None) -> list[int]:
    """Token ids of a prompt: a conversation rendered with the chat template (generation prompt added), or text."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    text = tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _call_reward(func: Callable, kwargs: dict) -> Any:
    """Run one reward function: async ones (and sync ones returning a coroutine) are awaited."""
    values = func(**kwargs)
    if is_async_callable(func) or inspect.iscoroutine(values):
        (values,) = _run_coroutines([values])
    return values


def _score_group(
    reward_funcs: list,
    reward_func_names: list[str],
    reward_processing_classes: list,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
) -> tuple[np.ndarray, np.ndarray]:
    """Rewards and advantages of one group.

    Every reward function is called with `prompts`, `completions`, `completion_ids` and the row's other columns
    repeated per completion (`None` → NaN). `R = nansum over functions` (no weights); over the scored completions (at
    least one non-NaN reward) the advantage is `(R − mean) / (std_pop + 1e−8)`; unscored ones get reward NaN and
    advantage 0.

    Returns:
        `(per_func, stacked)`: the `(n, F)` rewards of each function and the `(2, n)` stack of advantages and rewards.
    """
    num = len(completions)
    per_func = np.full((num, len(reward_funcs)), np.nan, dtype=np.float64)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    for index, (func, name) in enumerate(zip(reward_funcs, reward_func_names, strict=True)):
        if isinstance(func, nn.Module):
            tokenizer = reward_processing_classes[index]
            values = _OnlineRewardsMixin._score_with_reward_model(None, func, tokenizer, prompts, completions)
        else:
            values = _call_reward(func, kwargs)
        per_func[:, index] = _to_float_list(values, name, num, prompts)
    scored = ~np.isnan(per_func).all(axis=1)
    rewards = np.where(scored, np.nansum(np.where(np.isnan(per_func), 0.0, per_func), axis=1), np.nan)
    advantages = np.zeros(num, dtype=np.float64)
    if scored.any():
        values = rewards[scored]
        advantages[scored] = (values - values.mean()) / (values.std() + ADVANTAGE_EPS)
    return per_func, np.stack([advantages, rewards])


class AsyncRolloutWorker:
    """Generates and scores rollouts beside training and hands them to the trainer through `rollout_buffer`.

    Implements `RolloutWorkerProtocol`. The loop runs on a daemon thread (TRL 1.16: a spawned process); its failure is
    kept and re-raised by `check_health` (and by `start` when it happens before the loop is ready).

    Args:
        queue_maxsize: Capacity of `rollout_buffer` (0: unbounded).
        child_ready_timeout: Seconds `start()` waits for the backend to answer.
        **loop_kwargs: The loop's inputs: `backend` ([`GenerationBackend`]), `dataset` (rows with a `prompt`),
            `tokenizer`, `reward_funcs`, `reward_func_names`, `reward_processing_classes`, `num_generations`,
            `max_completion_length`, `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `model_name`,
            `chat_template_kwargs`, `fork_threshold_tokens`, `dataset_start_index` and `backend_timeout`.
    """

    def __init__(self, *, queue_maxsize: int = 0, child_ready_timeout: int = 300, **loop_kwargs):
        backend = loop_kwargs.get("backend")
        if not isinstance(backend, GenerationBackend):
            raise TypeError(
                f"AsyncRolloutWorker needs `backend=`, an object with `check_ready(timeout)` and "
                f"`generate(prompt_ids, n, sampling)`; got {type(backend).__name__}."
            )
        self.loop_kwargs = loop_kwargs
        self.child_ready_timeout = child_ready_timeout
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=_METRICS_QUEUE_SIZE)
        self._version_lock = threading.Lock()
        self._model_version = 0
        self._lora_name: str | None = None
        self._heartbeat = time.time()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._failed = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def model_version(self) -> int:
        """The policy version new groups are stamped with."""
        with self._version_lock:
            return self._model_version

    @model_version.setter
    def model_version(self, value: int) -> None:
        with self._version_lock:
            self._model_version = int(value)

    def update_model_version(self, model_version: int, lora_name: str | None = None) -> None:
        """Called by the trainer after each weight sync.

        Args:
            model_version: The policy version new groups are stamped with.
            lora_name: With adapter-only sync, the name the server loaded that version's adapter under: new groups
                generate with it (the `model` of OpenAI requests, `lora_name` of `trl vllm-serve`'s).
        """
        with self._version_lock:
            self._model_version = int(model_version)
            self._lora_name = lora_name

    def _policy(self) -> tuple[int, str | None]:
        """The policy version and adapter name, read together."""
        with self._version_lock:
            return self._model_version, self._lora_name

    def start(self) -> None:
        """Start the loop; returns once the backend answered, raises the loop's error if it failed first."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="AsyncRolloutWorker", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.child_ready_timeout):
            self.stop()
            raise TimeoutError(f"The rollout worker was not ready after {self.child_ready_timeout} s.")
        if self._failed.is_set():
            self.stop()
            raise RuntimeError(f"The rollout worker failed to start: {self._error!r}") from self._error

    def check_health(self, stale_after_s: float) -> None:
        """Raise when the loop failed (chaining its error), exited, or has not beaten for `stale_after_s` seconds."""
        if self._failed.is_set():
            raise RuntimeError(f"The rollout worker failed: {self._error!r}") from self._error
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("The rollout worker exited unexpectedly.")
        age = time.time() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(
                f"The rollout worker has not made progress for {age:.0f} s (heartbeat_stale_after_s={stale_after_s}); "
                "is the generation server stuck?"
            )

    def stop(self) -> None:
        """Ask the loop to stop and wait (15 s at most) for it; safe to call more than once."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(15.0)
            if self._thread.is_alive():
                logger.warning("The rollout worker did not stop within 15 s; it is left as a daemon thread.")

    # -- the loop ----------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            kwargs = self.loop_kwargs
            kwargs["backend"].check_ready(kwargs.get("backend_timeout", 240.0))
            self._heartbeat = time.time()
            self._ready.set()
            self._loop(**kwargs)
        except BaseException as error:  # noqa: BLE001 - kept and re-raised on the trainer's side
            logger.error("The rollout worker failed: %r", error)
            self._error = error
            self._failed.set()
            self._ready.set()

    def _loop(self, *, dataset, dataset_start_index: int = 0, **kwargs) -> None:
        index, group_id = dataset_start_index, 0
        while not self._stop.is_set():
            row = dict(dataset[index % len(dataset)])
            index += 1
            self._rollout_group(row, group_id, **kwargs)
            group_id += 1

    def _put(self, sample: RolloutSample) -> float:
        """Put a sample into the bounded buffer, backing off while it is full; returns the time waited."""
        start = time.perf_counter()
        while not self._stop.is_set():
            sample.enqueued_at = time.time()
            try:
                self.rollout_buffer.put_nowait(sample)
                break
            except queue.Full:
                self._heartbeat = time.time()
                time.sleep(_PUT_RETRY_S)
        return time.perf_counter() - start

    def _rollout_group(
        self,
        row: dict,
        group_id: int,
        *,
        backend: GenerationBackend,
        tokenizer: Any,
        reward_funcs: list,
        reward_func_names: list[str],
        reward_processing_classes: list | None = None,
        num_generations: int = 8,
        max_completion_length: int = 2048,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        model_name: str = "",
        chat_template_kwargs: dict | None = None,
        fork_threshold_tokens: int = 1024,
        **_: Any,
    ) -> None:
        version, lora_name = self._policy()
        start = time.perf_counter()
        prompt = row["prompt"]
        prompt_ids = _render_prompt(tokenizer, prompt, chat_template_kwargs)
        sampling = {
            "max_tokens": max_completion_length, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "min_p": min_p, "repetition_penalty": repetition_penalty, "model": lora_name or model_name,
            "lora_name": lora_name,
        }  # fmt: skip
        outputs = backend.generate(prompt_ids, num_generations, sampling)
        self._heartbeat = time.time()
        generate_s = time.perf_counter() - start
        completion_ids = [ids for ids, _ in outputs]
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        conversational = not isinstance(prompt, str)
        completions = [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
        columns = {key: [value] * len(outputs) for key, value in row.items() if key not in ("prompt", "completion")}
        score_start = time.perf_counter()
        per_func, (advantages, rewards) = _score_group(
            reward_funcs, reward_func_names, reward_processing_classes or [None] * len(reward_funcs),
            [prompt] * len(outputs), completions, completion_ids, columns,
        )  # fmt: skip
        score_s = time.perf_counter() - score_start
        scored = rewards[~np.isnan(rewards)]
        reward_std = float(scored.std()) if scored.size else math.nan
        backpressure_s, num_samples = 0.0, 0
        for i, (ids, logprobs) in enumerate(outputs):
            turn = TurnRecord(prompt_ids=prompt_ids, output_ids=list(ids), output_log_probs=list(logprobs))
            sequences, _ = _chain_to_sequences([turn], f"{group_id}-{i}", fork_threshold_tokens)
            metrics = {"reward": float(rewards[i]), "reward_std": reward_std}
            for name, value in zip(reward_func_names, per_func[i], strict=True):
                metrics[f"rewards/{name}"] = float(value)
            for sequence in sequences:
                sample = RolloutSample(
                    prompt=prompt, completion=completions[i], input_ids=np.asarray(sequence.input_ids),
                    completion_mask=np.asarray(sequence.completion_mask),
                    old_log_probs=np.asarray(sequence.old_log_probs, dtype=np.float32),
                    advantage=float(advantages[i]), model_version=version, group_id=group_id, metrics=metrics,
                )  # fmt: skip
                backpressure_s += self._put(sample)
                num_samples += 1
        lengths = [len(ids) for ids in completion_ids]
        self._send_metrics(
            {
                "rollout/duration_s": time.perf_counter() - start,
                "rollout/generated_tok_s": sum(lengths) / max(generate_s, 1e-9),
                "rollout/score_s": score_s,
                "rollout/backpressure_s": backpressure_s,
                "rollout/samples_per_rollout": num_samples / max(len(outputs), 1),
                "rollout/turns_mean": 1.0,
                "rollout/turns_max": 1.0,
                "rollout/fork_frac": 0.0,
                "rollout/realign_frac": 0.0,
                "completions/mean_length": float(np.mean(lengths)) if lengths else 0.0,
                "completions/max_length": float(max(lengths, default=0)),
                "completions/min_length": float(min(lengths, default=0)),
                "completions/clipped_ratio": float(np.mean([n >= max_completion_length for n in lengths]))
                if lengths
                else 0.0,
            }
        )

    def _send_metrics(self, metrics: dict[str, float]) -> None:
        try:
            self.metrics_queue.put_nowait(metrics)
        except queue.Full:  # as TRL: metrics are dropped rather than blocking the rollouts
            pass

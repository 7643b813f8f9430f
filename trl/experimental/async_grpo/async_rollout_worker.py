"""The rollout worker: generation beside training, scoring, and the samples it hands to the trainer.

[`AsyncRolloutWorker`] runs the rollout loop on a background thread of the trainer process: it cycles over the
prompts, samples `num_generations` completions per prompt through a [`GenerationBackend`], scores the group with the
reward functions, computes the group-relative advantages and puts one [`RolloutSample`] per training row into the
bounded `rollout_buffer`, stamped with the policy version the group was opened at.

With `tools` or `environment_factory`, every rollout is a multi-turn conversation (`_conversation.py`): up to
`max_inflight_tasks` of them run at once on a thread pool, and a group is scored once its last conversation ends.

TRL 1.16 runs this loop in a spawned child process (one asyncio loop); this version runs it on a daemon thread (one
group at a time without tools), see `docs/async_grpo.md`.
"""

from __future__ import annotations

import inspect
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.nn as nn

from ...trainer.online_rewards import _OnlineRewardsMixin, _run_coroutines, _to_float_list
from ...trainer.utils import is_async_callable
from ._backends import GenerationBackend
from ._conversation import ConversationResult, ToolRuntime, group_metrics, tool_frequencies
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


@dataclass
class _OpenGroup:
    """A row whose conversations are running: the row, the policy version it was opened at, results so far."""

    row: dict[str, Any]
    model_version: int
    size: int
    started: float = field(default_factory=time.perf_counter)
    results: list = field(init=False)

    def __post_init__(self):
        self.results = [None] * self.size


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


def _sampling_settings(lora_name: str | None, settings: dict[str, Any]) -> dict[str, Any]:
    """The `sampling` argument of `GenerationBackend.generate`, from the loop's settings (`model_name`,
    `max_completion_length`, `temperature`, ...; the adapter's name is the model's under LoRA sync)."""
    get = settings.get
    return {
        "max_tokens": get("max_completion_length", 2048), "temperature": get("temperature", 1.0),
        "top_p": get("top_p", 1.0), "top_k": get("top_k", 0), "min_p": get("min_p"),
        "repetition_penalty": get("repetition_penalty", 1.0), "model": lora_name or get("model_name", ""),
        "lora_name": lora_name,
    }  # fmt: skip


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
    extra_columns: list[tuple[str, list]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Rewards and advantages of one group.

    Every reward function is called with `prompts`, `completions`, `completion_ids` and the row's other columns
    repeated per completion (`None` → NaN). `extra_columns` (`(name, values)`, e.g. the environments' rewards) are
    appended as further reward columns. `R = nansum over columns` (no weights); over the scored completions (at least
    one non-NaN reward) the advantage is `(R − mean) / (std_pop + 1e−8)`; unscored ones get reward NaN and advantage 0.

    Returns:
        `(per_func, stacked)`: the `(n, F + E)` rewards of each column and the `(2, n)` stack of advantages and
        rewards.
    """
    num = len(completions)
    extra_columns = extra_columns or []
    per_func = np.full((num, len(reward_funcs) + len(extra_columns)), np.nan, dtype=np.float64)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    for index, (func, name) in enumerate(zip(reward_funcs, reward_func_names, strict=True)):
        if isinstance(func, nn.Module):
            tokenizer = reward_processing_classes[index]
            values = _OnlineRewardsMixin._score_with_reward_model(None, func, tokenizer, prompts, completions)
        else:
            values = _call_reward(func, kwargs)
        per_func[:, index] = _to_float_list(values, name, num, prompts)
    for index, (name, values) in enumerate(extra_columns, start=len(reward_funcs)):
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
            `chat_template_kwargs`, `fork_threshold_tokens`, `dataset_start_index`, `backend_timeout`, and for
            multi-turn rollouts `tools`, `environment_factory` (a callable, a dict name → callable, or a probed
            `_EnvironmentPool`), `max_tool_calling_iterations` and `max_inflight_tasks`.
    """

    def __init__(self, *, queue_maxsize: int = 0, child_ready_timeout: int = 300, **loop_kwargs):
        backend = loop_kwargs.get("backend")
        if not isinstance(backend, GenerationBackend):
            raise TypeError(
                f"AsyncRolloutWorker needs `backend=`, an object with `check_ready(timeout)` and "
                f"`generate(prompt_ids, n, sampling)`; got {type(backend).__name__}."
            )
        self.loop_kwargs = loop_kwargs
        # Tools or environments make every rollout a multi-turn conversation; built here so that a bad tool,
        # environment or tokenizer fails on construction rather than in the loop.
        self._tool_runtime: ToolRuntime | None = None
        if loop_kwargs.get("tools") or loop_kwargs.get("environment_factory") is not None:
            self._tool_runtime = ToolRuntime(
                loop_kwargs["tokenizer"],
                tools=loop_kwargs.get("tools"),
                environment_factory=loop_kwargs.get("environment_factory"),
                chat_template_kwargs=loop_kwargs.get("chat_template_kwargs"),
                max_tool_calling_iterations=loop_kwargs.get("max_tool_calling_iterations"),
            )
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
        if self._tool_runtime is not None:
            self._loop_conversations(dataset, dataset_start_index, **kwargs)
            return
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
        sampling = _sampling_settings(lora_name, {
            "model_name": model_name, "max_completion_length": max_completion_length, "temperature": temperature,
            "top_p": top_p, "top_k": top_k, "min_p": min_p, "repetition_penalty": repetition_penalty,
        })  # fmt: skip
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
        sequences = [
            _chain_to_sequences(
                [TurnRecord(prompt_ids=prompt_ids, output_ids=list(ids), output_log_probs=list(logprobs))],
                f"{group_id}-{i}",
                fork_threshold_tokens,
            )[0]
            for i, (ids, logprobs) in enumerate(outputs)
        ]
        backpressure_s, num_samples = self._emit_group(
            [prompt] * len(outputs), completions, sequences, reward_func_names, per_func, advantages, rewards,
            version, group_id,
        )  # fmt: skip
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
                "rollout/drift_tokens_mean": 0.0,
                "rollout/drift_tokens_max": 0.0,
                "rollout/inflight": float(len(outputs)),
                "completions/mean_length": float(np.mean(lengths)) if lengths else 0.0,
                "completions/max_length": float(max(lengths, default=0)),
                "completions/min_length": float(min(lengths, default=0)),
                "completions/clipped_ratio": float(np.mean([n >= max_completion_length for n in lengths]))
                if lengths
                else 0.0,
            }
        )

    # -- multi-turn conversations (tools, environments) ---------------------------------------------------------------

    def _loop_conversations(
        self,
        dataset,
        dataset_start_index: int = 0,
        *,
        backend: GenerationBackend,
        num_generations: int = 8,
        max_inflight_tasks: int = -1,
        **kwargs: Any,
    ) -> None:
        """Run up to `max_inflight_tasks` conversations at once on a thread pool (each row opens `num_generations`
        of them, sharing a group id); a group is scored and queued as soon as its last conversation ends."""
        slots = max_inflight_tasks if max_inflight_tasks > 0 else num_generations
        groups: dict[int, _OpenGroup] = {}
        inflight: dict[Future, tuple[int, int]] = {}
        index, group_id, generation = dataset_start_index, 0, 0

        def sampling() -> dict[str, Any]:
            return _sampling_settings(self._policy()[1], kwargs)

        def beat() -> None:
            self._heartbeat = time.time()

        executor = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="AsyncRolloutConversation")
        try:
            while not self._stop.is_set():
                while len(inflight) < slots:
                    if generation == 0:  # open the next row's group, stamped with the current policy version
                        row = dict(dataset[index % len(dataset)])
                        index += 1
                        groups[group_id] = _OpenGroup(row, self._policy()[0], num_generations)
                    future = executor.submit(
                        self._run_conversation, groups[group_id].row, backend, sampling, self._stop, beat
                    )
                    inflight[future] = (group_id, generation)
                    generation += 1
                    if generation == num_generations:
                        group_id, generation = group_id + 1, 0
                done, _ = wait(list(inflight), timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    owner, position = inflight.pop(future)
                    result = future.result()  # a failed conversation fails the worker
                    if result is None:  # stopping
                        continue
                    group = groups[owner]
                    group.results[position] = result
                    if all(item is not None for item in group.results):
                        del groups[owner]
                        self._finish_conversations(group, owner, len(inflight), **kwargs)
        finally:
            # Running conversations end after their current turn (they watch the stop event); waiting for them means
            # no conversation outlives the loop and every environment is back in the pool.
            self._stop.set()
            executor.shutdown(wait=True, cancel_futures=True)
            finished = [result for group in groups.values() for result in group.results]
            finished += [f.result() for f in inflight if f.done() and not f.cancelled() and f.exception() is None]
            for result in finished:
                if result is not None:
                    self._release(result)

    def _finish_conversations(
        self,
        group: _OpenGroup,
        group_id: int,
        inflight: int,
        **kwargs: Any,
    ) -> None:
        """Score a finished group of conversations, queue its training rows and send its metrics (`kwargs`: the
        loop's settings, `reward_funcs`, `reward_func_names`, `reward_processing_classes`, `max_completion_length`,
        `fork_threshold_tokens`, ...)."""
        reward_funcs, reward_func_names = kwargs["reward_funcs"], kwargs["reward_func_names"]
        results: list[ConversationResult] = group.results
        try:
            prompts = [result.prompt for result in results]
            completions = [result.completion for result in results]
            completion_ids = [result.completion_ids for result in results]
            columns = {
                key: [value] * len(results)
                for key, value in group.row.items()
                if key not in ("prompt", "completion", "completion_ids")
            }
            score_start = time.perf_counter()
            extra_columns, extra_metrics = self._extra_reward_columns(results)
            per_func, (advantages, rewards) = _score_group(
                reward_funcs, reward_func_names, kwargs.get("reward_processing_classes") or [None] * len(reward_funcs),
                prompts, completions, completion_ids, columns, extra_columns=extra_columns,
            )  # fmt: skip
            score_s = time.perf_counter() - score_start
        finally:
            for result in results:  # the environments' rewards are read: their instances can serve other rows
                self._release(result)
        sequences, drift_stats = [], []
        for i, result in enumerate(results):
            rows, stats = _chain_to_sequences(
                result.turns, f"{group_id}-{i}", kwargs.get("fork_threshold_tokens", 1024)
            )
            sequences.append(rows)
            drift_stats.append(stats)
        backpressure_s, num_samples = self._emit_group(
            prompts, completions, sequences, list(reward_func_names) + [name for name, _ in extra_columns], per_func,
            advantages, rewards, group.model_version, group_id, extra_metrics=tool_frequencies(results),
        )  # fmt: skip
        generated = sum(len(ids) for ids in completion_ids)
        metrics = {
            "rollout/duration_s": time.perf_counter() - group.started,
            "rollout/generated_tok_s": generated / max(sum(result.generate_s for result in results), 1e-9),
            "rollout/score_s": score_s,
            "rollout/backpressure_s": backpressure_s,
            "rollout/samples_per_rollout": num_samples / max(len(results), 1),
            "rollout/inflight": float(inflight),
            **group_metrics(results, drift_stats, kwargs.get("max_completion_length", 2048)),
            **extra_metrics,
        }
        self._send_metrics(metrics)

    # Hooks of the multi-turn loop: subclasses (the OpenEnv harness worker) run conversations their own way and add
    # their own reward columns, while the scheduling, scoring, reconciliation and metrics above stay shared.

    def _run_conversation(
        self,
        row: dict[str, Any],
        backend: GenerationBackend,
        sampling_fn: Callable[[], dict[str, Any]],
        stop: threading.Event,
        on_turn: Callable[[], None],
    ) -> ConversationResult | None:
        """Run one conversation of `row` on a pool thread (None when the worker stopped); see `ToolRuntime.run`."""
        return self._tool_runtime.run(row, backend, sampling_fn, stop, on_turn)

    def _release(self, result: ConversationResult) -> None:
        """Free what a finished (or abandoned) conversation still holds, e.g. its environment."""
        self._tool_runtime.release(result)

    def _extra_reward_columns(
        self, results: list[ConversationResult]
    ) -> tuple[list[tuple[str, list[Any]]], dict[str, float]]:
        """Reward columns appended after the reward functions' (`(name, per-conversation values)`) and the metrics
        computing them produced: the environments' `get_reward()` columns and `env/reward_s`."""
        runtime = self._tool_runtime
        env_columns, env_reward_s = runtime.environment_rewards(results)
        metrics = {"env/reward_s": env_reward_s} if runtime.reward_classes else {}
        return list(zip(runtime.reward_names, env_columns, strict=True)), metrics

    def _emit_group(
        self,
        prompts: list,
        completions: list,
        sequences: list[list[TrainingSequence]],
        reward_names: list[str],
        per_func: np.ndarray,
        advantages: np.ndarray,
        rewards: np.ndarray,
        version: int,
        group_id: int,
        extra_metrics: dict[str, float] | None = None,
    ) -> tuple[float, int]:
        """Queue one [`RolloutSample`] per training row of a scored group (every row of a completion carries its
        advantage); returns the time spent waiting on the full buffer and the number of samples."""
        scored = rewards[~np.isnan(rewards)]
        reward_std = float(scored.std()) if scored.size else math.nan
        backpressure_s, num_samples = 0.0, 0
        for i, rows in enumerate(sequences):
            metrics = {"reward": float(rewards[i]), "reward_std": reward_std}
            for name, value in zip(reward_names, per_func[i], strict=True):
                metrics[f"rewards/{name}"] = float(value)
            metrics.update(extra_metrics or {})
            for sequence in rows:
                sample = RolloutSample(
                    prompt=prompts[i], completion=completions[i], input_ids=np.asarray(sequence.input_ids),
                    completion_mask=np.asarray(sequence.completion_mask),
                    old_log_probs=np.asarray(sequence.old_log_probs, dtype=np.float32),
                    advantage=float(advantages[i]), model_version=version, group_id=group_id, metrics=metrics,
                )  # fmt: skip
                backpressure_s += self._put(sample)
                num_samples += 1
        return backpressure_s, num_samples

    def _send_metrics(self, metrics: dict[str, float]) -> None:
        try:
            self.metrics_queue.put_nowait(metrics)
        except queue.Full:  # as TRL: metrics are dropped rather than blocking the rollouts
            pass

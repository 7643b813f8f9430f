"""The rollout worker of asynchronous distillation: one student completion per prompt, scored by its teacher server.

[`AsyncRolloutWorker`] reuses AsyncGRPO's worker (thread, bounded queue, heartbeat, version stamping, metrics queue)
and replaces what one task does: render the prompt, sample one completion from the student's server, ask the row's
teacher for its top-k log-probabilities at every completion token, and queue a [`RolloutSample`] holding them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..async_grpo.async_rollout_worker import AsyncRolloutWorker as _AsyncGRPORolloutWorker
from ..async_grpo.async_rollout_worker import _render_prompt


__all__ = ["AsyncRolloutWorker", "RolloutSample", "teacher_candidates"]


@dataclass
class RolloutSample:
    """One training sequence: prompt + completion ids, and per token the teacher's candidates for it.

    `teacher_topk_ids` / `teacher_topk_logprobs` are `(len(input_ids), teacher_top_k + 1)`: at a completion token,
    the teacher's candidates for that token in rank order (its top-k, plus the realised token when outside them),
    padded with id -1 / -inf; prompt positions hold padding only.
    """

    prompt: list[dict[str, str]]
    completion: list[dict[str, str]]
    input_ids: np.ndarray
    completion_mask: np.ndarray
    teacher_topk_ids: np.ndarray
    teacher_topk_logprobs: np.ndarray
    model_version: int
    metrics: dict[str, float]
    teacher_id: str
    prompt_id: int
    enqueued_at: float | None = None


def teacher_candidates(
    scores: dict[str, list], completion_ids: list[int], top_k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per completion token, the teacher's candidates `(ids, log-probs)`, each `(len(completion_ids), top_k + 1)`.

    Args:
        scores: `VLLMClient.get_sequence_logprobs` output for one sequence (lists of length 1).
        completion_ids: The sampled completion.
        top_k: Candidates requested from the teacher.

    Returns:
        The top-k in rank order followed by the realised token when it is not among them; NaN or missing entries are
        dropped; rows padded with id -1 and log-prob -inf.
    """
    width = top_k + 1
    ids = np.full((len(completion_ids), width), -1, dtype=np.int64)
    logprobs = np.full((len(completion_ids), width), -np.inf, dtype=np.float32)
    top_lps, top_ids = scores["logprobs"][0], scores["logprob_token_ids"][0]
    actual = scores["actual_logprobs"][0]
    for t, token in enumerate(completion_ids):
        row = [
            (int(i), float(lp))
            for i, lp in zip(top_ids[t] if t < len(top_ids) else [], top_lps[t] if t < len(top_lps) else [])
            if lp is not None and math.isfinite(float(lp))
        ][:top_k]
        if all(i != token for i, _ in row) and t < len(actual):
            value = actual[t][0] if isinstance(actual[t], (list, tuple)) else actual[t]
            if value is not None and math.isfinite(float(value)):
                row.append((int(token), float(value)))
        for k, (i, lp) in enumerate(row):
            ids[t, k], logprobs[t, k] = i, lp
    return ids, logprobs


class AsyncRolloutWorker(_AsyncGRPORolloutWorker):
    """AsyncGRPO's rollout worker doing distillation tasks (see the module docstring).

    Args:
        queue_maxsize: Capacity of `rollout_buffer` (0: unbounded).
        child_ready_timeout: Seconds `start()` waits for the student's server.
        **loop_kwargs: `backend`, `dataset` (rows with a `prompt`, and `teacher_id` with several teachers),
            `dataset_start_index`, `tokenizer`, `teacher_clients` (teacher id -> client with
            `get_sequence_logprobs`), `teacher_top_k`, `teacher_temperature`, `max_completion_length`, `temperature`,
            `top_p`, `top_k`, `min_p`, `repetition_penalty`, `model_name`, `chat_template_kwargs`, `backend_timeout`.
    """

    def _rollout_group(
        self,
        row: dict,
        group_id: int,
        *,
        backend: Any,
        tokenizer: Any,
        teacher_clients: dict[str, Any],
        teacher_top_k: int = 8,
        teacher_temperature: float = 1.0,
        max_completion_length: int = 2048,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        model_name: str = "",
        chat_template_kwargs: dict | None = None,
        **_: Any,
    ) -> None:
        version, lora_name = self._policy()
        start = time.perf_counter()
        teacher_id = _row_teacher(row, teacher_clients)
        prompt = row["prompt"]
        prompt_ids = _render_prompt(tokenizer, prompt, chat_template_kwargs)
        sampling = {
            "max_tokens": max_completion_length, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "min_p": min_p, "repetition_penalty": repetition_penalty, "model": lora_name or model_name,
            "lora_name": lora_name,
        }  # fmt: skip
        ((completion_ids, _),) = backend.generate(prompt_ids, 1, sampling)
        completion_ids = list(completion_ids)
        self._heartbeat = time.time()
        generate_s = time.perf_counter() - start
        score_start = time.perf_counter()
        scores = teacher_clients[teacher_id].get_sequence_logprobs(
            [prompt_ids + completion_ids],
            [len(prompt_ids)],
            top_logprobs=teacher_top_k,
            temperature=teacher_temperature,
        )
        score_s = time.perf_counter() - score_start
        self._heartbeat = time.time()
        ids, logprobs = teacher_candidates(scores, completion_ids, teacher_top_k)
        prompt_pad = len(prompt_ids)
        text = tokenizer.decode(completion_ids, skip_special_tokens=True)
        sample = RolloutSample(
            prompt=prompt,
            completion=[{"role": "assistant", "content": text}] if not isinstance(prompt, str) else text,
            input_ids=np.asarray(prompt_ids + completion_ids, dtype=np.int64),
            completion_mask=np.asarray([0] * prompt_pad + [1] * len(completion_ids), dtype=np.int64),
            teacher_topk_ids=np.concatenate([np.full((prompt_pad, ids.shape[1]), -1, dtype=np.int64), ids]),
            teacher_topk_logprobs=np.concatenate(
                [np.full((prompt_pad, ids.shape[1]), -np.inf, dtype=np.float32), logprobs]
            ),
            model_version=version,
            metrics={},
            teacher_id=teacher_id,
            prompt_id=group_id,
        )
        backpressure_s = self._put(sample)
        length = len(completion_ids)
        metrics = {
            "rollout/inflight": 1.0,
            "rollout/duration_s": time.perf_counter() - start,
            "rollout/generated_tok_s": length / max(generate_s, 1e-9),
            "rollout/backpressure_s": backpressure_s,
            "rollout/vllm_retry_total": 0.0,
            "rollout/score_s": score_s,
            "completions/mean_length": float(length),
            "completions/max_length": float(length),
            "completions/min_length": float(length),
            "completions/clipped_ratio": float(length >= max_completion_length),
        }
        if len(teacher_clients) > 1:
            metrics[f"teacher_score_s/{teacher_id}"] = score_s
        self._send_metrics(metrics)


def _row_teacher(row: dict, teacher_clients: dict[str, Any]) -> str:
    """The teacher of a row: the only one, or the row's `teacher_id` (which must name a configured teacher)."""
    if len(teacher_clients) == 1:
        return next(iter(teacher_clients))
    teacher_id = row.get("teacher_id")
    if teacher_id not in teacher_clients:
        raise ValueError(
            f"With several teachers ({sorted(teacher_clients)}), every row needs a `teacher_id` naming one of them; "
            f"got {teacher_id!r}."
        )
    return teacher_id

"""Scoring fixed sequences through an OpenAI-compatible vLLM server (`vllm serve`): `/v1/completions` with
`prompt_logprobs`.

A plain `vllm serve <teacher>` has no scoring endpoint of its own; a completion request whose prompt is the whole
sequence, with `max_tokens=1` and `prompt_logprobs=k`, returns for every prompt position the top-k log-probabilities
(and the realised token's, with its rank). [`parse_prompt_logprobs`] turns that answer into the layout of
`VLLMClient.get_sequence_logprobs`.
"""

import math
from typing import Any


__all__ = ["completions_scoring_payload", "parse_prompt_logprobs"]


def completions_scoring_payload(
    model: str, sequences: list[list[int]], top_logprobs: int, temperature: float
) -> dict[str, Any]:
    """The `/v1/completions` request scoring `sequences` (token ids), as TRL 1.16 sends it."""
    return {
        "model": model,
        "prompt": sequences,
        "max_tokens": 1,
        "temperature": temperature,
        "prompt_logprobs": top_logprobs,
    }


def _logprob(entry: Any) -> float:
    value = entry.get("logprob") if isinstance(entry, dict) else entry
    return float("-inf") if value is None else float(value)


def parse_prompt_logprobs(
    choices: list[dict[str, Any]], sequences: list[list[int]], prompt_lengths: list[int], top_logprobs: int
) -> dict[str, list]:
    """Per sequence, per completion position: the top-k and the realised token's log-probabilities.

    Args:
        choices: The response's `choices` (one per prompt, ordered by their `index`), each with `prompt_logprobs`: per
            prompt position `None` (the first) or a dict `{token id (str): {"logprob", "rank", ...}}`.
        sequences: The scored token ids.
        prompt_lengths: Prompt length of each sequence; positions from it on are returned.
        top_logprobs: `k`: entries kept per position, in rank order, padded with `(-inf, 0)`.

    Returns:
        `logprobs` / `logprob_token_ids` (`[sequence][position][k]`), `actual_logprobs` / `actual_token_ids`
        (`[sequence][position][1]`, `-inf` when the server did not report the realised token).

    Raises:
        ValueError: When the number of choices differs from the number of sequences.
    """
    if len(choices) != len(sequences):
        raise ValueError(
            f"The server answered {len(choices)} choices for {len(sequences)} sequences; an OpenAI-compatible server "
            "must return one choice per prompt."
        )
    choices = sorted(choices, key=lambda choice: choice.get("index", 0))
    out: dict[str, list] = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
    for choice, sequence, prompt_length in zip(choices, sequences, prompt_lengths, strict=True):
        positions = choice.get("prompt_logprobs") or []
        top_rows, id_rows, actual_rows, actual_ids = [], [], [], []
        for position in range(prompt_length, len(sequence)):
            entries = positions[position] if position < len(positions) else None
            entries = entries or {}
            ranked = sorted(
                (
                    (int(token), _logprob(entry), (entry or {}).get("rank", math.inf))
                    for token, entry in entries.items()
                ),
                key=lambda item: (item[2], -item[1]),
            )[:top_logprobs]
            ranked += [(0, float("-inf"), math.inf)] * (top_logprobs - len(ranked))
            id_rows.append([token for token, _, _ in ranked])
            top_rows.append([logprob for _, logprob, _ in ranked])
            token = sequence[position]
            realised = entries.get(str(token))
            actual_rows.append([_logprob(realised) if realised is not None else float("-inf")])
            actual_ids.append([token])
        out["logprobs"].append(top_rows)
        out["logprob_token_ids"].append(id_rows)
        out["actual_logprobs"].append(actual_rows)
        out["actual_token_ids"].append(actual_ids)
    return out

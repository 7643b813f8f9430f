"""Turning the turns of one conversation into training rows (token drift between turns).

Each turn re-renders the whole conversation with the chat template, so the new prompt may not extend the tokens held
so far (templates that rewrite earlier turns, tool-call parsing, ...). The common prefix decides what to do:
`CLEAN` (the new prompt extends the held tokens), `REALIGN` (a short tail after the last output's start differs:
overwrite it) or `FORK` (start a new row). Public names are re-exported by `async_rollout_worker`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class DriftKind(str, enum.Enum):
    """How a new turn's prompt relates to the tokens already held for the conversation."""

    CLEAN = "clean"
    REALIGN = "realign"
    FORK = "fork"


@dataclass
class TurnRecord:
    """One generated turn: the rendered prompt, the sampled tokens and their sampler log-probabilities.

    `output_mask` marks which output tokens are trained (all when None).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None


@dataclass
class TrainingSequence:
    """One training row: tokens, which of them are trained, and the sampler log-probability of each token."""

    input_ids: list[int]
    completion_mask: list[int]
    old_log_probs: list[float]
    rollout_id: str


def _common_prefix_len(a: list[int], b: list[int], chunk: int = 4096) -> int:
    """Length of the longest common prefix of `a` and `b` (compared chunk by chunk)."""
    limit = min(len(a), len(b))
    start = 0
    while start < limit:
        end = min(start + chunk, limit)
        if a[start:end] != b[start:end]:
            for index in range(start, end):
                if a[index] != b[index]:
                    return index
        start = end
    return limit


class _RowBuilder:
    """The training row being built for a conversation."""

    def __init__(self, prompt_ids: list[int]):
        self.input_ids = list(prompt_ids)
        self.mask = [0] * len(prompt_ids)
        self.logps = [0.0] * len(prompt_ids)
        self.last_output_start = len(prompt_ids)

    def truncate(self, length: int) -> None:
        del self.input_ids[length:], self.mask[length:], self.logps[length:]

    def add_context(self, token_ids: list[int]) -> None:
        self.input_ids += token_ids
        self.mask += [0] * len(token_ids)
        self.logps += [0.0] * len(token_ids)

    def add_outputs(self, turn: TurnRecord) -> None:
        self.last_output_start = len(self.input_ids)
        mask = turn.output_mask if turn.output_mask is not None else [1] * len(turn.output_ids)
        logps = list(turn.output_log_probs) + [0.0] * (len(turn.output_ids) - len(turn.output_log_probs))
        self.input_ids += list(turn.output_ids)
        self.mask += [int(value) for value in mask]
        self.logps += [float(value) for value in logps]

    def to_sequence(self, rollout_id: str) -> TrainingSequence | None:
        if not any(self.mask):
            return None
        return TrainingSequence(list(self.input_ids), list(self.mask), list(self.logps), rollout_id)


def _chain_to_sequences(
    turns: list[TurnRecord], rollout_id: str, fork_threshold: int
) -> tuple[list[TrainingSequence], dict[str, float]]:
    """Training rows of a conversation and its drift statistics.

    For every turn after the first, `matched` is the common prefix of the held tokens and the new prompt and
    `drift = held - matched`. Drift 0 is `CLEAN` (the prompt's new tail is appended as untrained context); when
    `matched` reaches at least the start of the last output and `drift < fork_threshold` it is `REALIGN` (the held
    tail from `matched` is replaced by the prompt's tail); otherwise `FORK` (the row is closed and a new one starts
    from this turn's prompt). Rows without a trained token are dropped.

    Returns:
        `(rows, stats)` with stats `clean`, `realign`, `fork` (counts), `transitions`, `drift_tokens` (sum) and
        `drift_max`.
    """
    stats: dict[str, float] = dict.fromkeys(("clean", "realign", "fork", "transitions", "drift_tokens"), 0.0)
    stats["drift_max"] = 0.0
    rows: list[TrainingSequence] = []
    builder: _RowBuilder | None = None
    for turn in turns:
        prompt = list(turn.prompt_ids)
        if builder is None:
            builder = _RowBuilder(prompt)
        else:
            matched = _common_prefix_len(builder.input_ids, prompt)
            drift = len(builder.input_ids) - matched
            stats["transitions"] += 1
            stats["drift_tokens"] += drift
            stats["drift_max"] = max(stats["drift_max"], drift)
            if drift == 0:
                stats["clean"] += 1
                builder.add_context(prompt[matched:])
            elif matched >= builder.last_output_start and drift < fork_threshold:
                stats["realign"] += 1
                builder.truncate(matched)
                builder.add_context(prompt[matched:])
            else:
                stats["fork"] += 1
                row = builder.to_sequence(rollout_id)
                if row is not None:
                    rows.append(row)
                builder = _RowBuilder(prompt)
        builder.add_outputs(turn)
    if builder is not None:
        row = builder.to_sequence(rollout_id)
        if row is not None:
            rows.append(row)
    return rows, stats

"""Rewards built from parameters: length-aware correctness, repetition penalty, soft over-length punishment."""

import math
from collections.abc import Callable

from .accuracy_rewards import accuracy_reward


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> Callable[..., list[float | None]]:
    r"""Correctness reward scaled by length with a cosine schedule (shorter correct answers score higher).

    With `L` the completion length in tokens, `p = min(L / max_len, 1)` and `c = cos(p * pi)`, a correct completion
    gets `min_value_correct + 0.5 * (max_value_correct - min_value_correct) * (1 + c)` (from `max_value_correct` at
    length 0 down to `min_value_correct` at `max_len`); a wrong one gets the same formula with the bounds
    `(max_value_wrong, min_value_wrong)`, i.e. from `min_value_wrong` at length 0 up to `max_value_wrong` at
    `max_len` (short wrong answers are penalised more). Correctness comes from [`accuracy_reward`]; samples it skips
    (None) stay None.

    Args:
        max_len (`int`):
            Length at which the schedule reaches its end.
        min_value_wrong (`float`, defaults to `-1.0`):
            Reward of an empty wrong completion.
        max_value_wrong (`float`, defaults to `-0.5`):
            Reward of a wrong completion of length `max_len` or more.
        min_value_correct (`float`, defaults to `0.5`):
            Reward of a correct completion of length `max_len` or more.
        max_value_correct (`float`, defaults to `1.0`):
            Reward of an empty correct completion.

    Returns:
        A reward function named `cosine_scaled_reward` taking `completions`, `solution` and `completion_ids`.

    Example:
    ```python
    >>> from trl.rewards import get_cosine_scaled_reward
    >>> reward = get_cosine_scaled_reward(max_len=100)
    >>> completions = [[{"role": "assistant", "content": r"$\boxed{2}$"}]]
    >>> reward(completions, solution=["2"], completion_ids=[[0] * 50])
    [0.75]
    ```
    """

    return _CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> Callable[..., list[float]]:
    r"""Penalty proportional to the share of repeated n-grams in a completion's token ids.

    A completion with `T` n-grams of which `U` are distinct gets `(1 - U / T) * max_penalty`: 0 without repetition,
    approaching `max_penalty` when one n-gram repeats. Completions shorter than `ngram_size` get 0.

    Args:
        ngram_size (`int`, defaults to `3`):
            Length of the n-grams (in tokens).
        max_penalty (`float`, defaults to `-1.0`):
            Penalty of a fully repetitive completion; must be <= 0.

    Returns:
        A reward function named `repetition_penalty_reward` reading `completion_ids`.

    Example:
    ```python
    >>> from trl.rewards import get_repetition_penalty_reward
    >>> reward = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    >>> reward(completion_ids=[[1, 2, 3, 4], [1, 1, 1, 1]])
    [0.0, -0.6666666666666667]
    ```
    """
    if max_penalty > 0:
        raise ValueError(f"max_penalty is a penalty and must not be positive; got {max_penalty}.")
    if ngram_size < 1:
        raise ValueError(f"ngram_size must be a positive integer; got {ngram_size}.")

    return _RepetitionPenalty(ngram_size, max_penalty)


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable[..., list[float]]:
    r"""Length penalty that ramps up linearly in the last `soft_punish_cache` tokens before `max_completion_len` (DAPO).

    With `L` the completion length: `L <= max_completion_len - soft_punish_cache` gives 0; inside the cache window
    the reward is `(max_completion_len - soft_punish_cache - L) / soft_punish_cache` (from 0 down to -1); beyond
    `max_completion_len` it is -1.

    Args:
        max_completion_len (`int`):
            Maximum completion length in tokens.
        soft_punish_cache (`int`):
            Size of the window, before the maximum, in which the penalty grows.

    Returns:
        A reward function named `soft_overlong_punishment_reward` reading `completion_ids`.

    Example:
    ```python
    >>> from trl.rewards import get_soft_overlong_punishment
    >>> reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    >>> reward(completion_ids=[[0] * 70, [0] * 90, [0] * 120])
    [0.0, -0.5, -1.0]
    ```
    """
    if soft_punish_cache <= 0 or soft_punish_cache > max_completion_len:
        raise ValueError(
            f"soft_punish_cache must be in (0, max_completion_len={max_completion_len}]; got {soft_punish_cache}."
        )

    return _SoftOverlongPunishment(max_completion_len, soft_punish_cache)


# The factories return instances of these classes rather than closures, so that the reward functions pickle (dataloader
# workers, multiprocessing, `copy.deepcopy` of a trainer's state) as TRL's do. `__name__` names the reward in the logs.
class _CosineScaledReward:
    __name__ = "cosine_scaled_reward"

    def __init__(
        self,
        max_len: int,
        min_value_wrong: float,
        max_value_wrong: float,
        min_value_correct: float,
        max_value_correct: float,
    ):
        self.max_len = max_len
        self.min_value_wrong = min_value_wrong
        self.max_value_wrong = max_value_wrong
        self.min_value_correct = min_value_correct
        self.max_value_correct = max_value_correct

    def __call__(
        self, completions: list, solution: list[str], completion_ids: list[list[int]], **kwargs
    ) -> list[float | None]:
        correctness = accuracy_reward(completions, solution)
        rewards = []
        for ids, correct in zip(completion_ids, correctness, strict=True):
            if correct is None:
                rewards.append(None)
                continue
            progress = min(len(ids) / self.max_len, 1.0)
            cosine = math.cos(progress * math.pi)
            if correct:
                low, high = self.min_value_correct, self.max_value_correct
            else:
                low, high = self.max_value_wrong, self.min_value_wrong
            rewards.append(low + 0.5 * (high - low) * (1.0 + cosine))
        return rewards


class _RepetitionPenalty:
    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            ids = list(ids)
            if len(ids) < self.ngram_size:
                rewards.append(0.0)
                continue
            ngrams = [tuple(ids[i : i + self.ngram_size]) for i in range(len(ids) - self.ngram_size + 1)]
            # + 0.0 turns -0.0 into 0.0
            rewards.append((1.0 - len(set(ngrams)) / len(ngrams)) * self.max_penalty + 0.0)
        return rewards


class _SoftOverlongPunishment:
    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        rewards = []
        start = self.max_completion_len - self.soft_punish_cache
        for ids in completion_ids:
            length = len(ids)
            if length <= start:
                rewards.append(0.0)
            elif length <= self.max_completion_len:
                rewards.append((start - length) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards

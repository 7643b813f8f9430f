"""Rewards that check a completion's final answer against a reference solution (with `math_verify`)."""

import threading
from collections.abc import Callable

from ..import_utils import is_math_verify_available


_PARSE_TIMEOUT = 10
_VERIFY_TIMEOUT = 5


def _require_math_verify() -> None:
    if not is_math_verify_available():
        raise ImportError(
            "accuracy_reward and reasoning_accuracy_reward need the `math_verify` package to parse and compare "
            "answers. Install it with `pip install trl[math-verify]` (or `pip install math-verify`)."
        )


def _content(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def _timeouts() -> tuple[int | None, int | None]:
    # math_verify enforces timeouts with signals, which only work in the main thread.
    if threading.current_thread() is threading.main_thread():
        return _PARSE_TIMEOUT, _VERIFY_TIMEOUT
    return None, None


def _grade(answer_text: str, solution: str) -> tuple[float | None, str, str]:
    """Reward, parsed gold answer and parsed completion answer (as strings, for logging)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    parse_timeout, verify_timeout = _timeouts()
    gold = parse(solution, extraction_mode="first_match", parsing_timeout=parse_timeout)
    if len(gold) == 0:
        # The reference itself cannot be parsed: this sample cannot be graded, so it is skipped.
        return None, "[unparseable]", "[skipped]"
    extraction = LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            basic_latex=True, units=True, malformed_operators=False, nits=False, boxed="all"
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    answer = parse(
        answer_text, extraction_config=[extraction], extraction_mode="first_match", parsing_timeout=parse_timeout
    )
    try:
        reward = float(verify(gold, answer, timeout_seconds=verify_timeout))
    except Exception:
        reward = 0.0
    return reward, str(gold), str(answer)


def accuracy_reward(
    completions: list[list[dict[str, str]]],
    solution: list[str],
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs,
) -> list[float | None]:
    r"""1.0 when the completion's final answer is mathematically equal to the reference `solution`, else 0.0.

    The reference is parsed with `math_verify`; when it cannot be parsed the sample gets `None` (skipped). The
    completion's answer is extracted from LaTeX (boxed answers first, units normalised, no extraction without an
    anchor) and compared with `math_verify.verify`. Parsing and verification time out after 10 s and 5 s on the main
    thread.

    Args:
        completions (`list[list[dict[str, str]]]`):
            Conversational completions (the first message's `content` is graded); plain strings are accepted too.
        solution (`list[str]`):
            Reference solutions (a dataset column), one per completion.
        log_extra (`Callable[[str, list], None]` or `None`, defaults to `None`):
            When given (the trainers pass it), logs the columns `solution`, `gold_parsed` and `answer_parsed`.
        **kwargs:
            Other reward-function arguments, ignored.

    Returns:
        `list[float | None]`: One reward per completion.

    Example:
    ```python
    >>> from trl.rewards import accuracy_reward
    >>> solution = [r"\frac{1}{3}", r"\frac{1}{3}"]
    >>> completion = [
    ...     [{"role": "assistant", "content": r"My answer is $\boxed{\frac{1}{3}}$"}],
    ...     [{"role": "assistant", "content": r"My answer is $\boxed{\frac{1}{2}}$"}],
    ... ]
    >>> accuracy_reward(completion, solution)
    [1.0, 0.0]
    ```
    """
    _require_math_verify()
    rewards, golds, answers = [], [], []
    for completion, sol in zip(completions, solution, strict=True):
        reward, gold, answer = _grade(_content(completion), sol)
        rewards.append(reward)
        golds.append(gold)
        answers.append(answer)
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)
    return rewards


def reasoning_accuracy_reward(
    completions: list[list[dict[str, str]]],
    solution: list[str],
    reasoning_delimiters: list[str] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs,
) -> list[float | None]:
    r"""Like [`accuracy_reward`], but only the text after the reasoning block is graded.

    The answer is whatever follows the first delimiter found (by default `"</think>"`). A completion without any
    delimiter has not finished reasoning and gets 0.0 (logged as `[incomplete reasoning]`).

    Args:
        completions (`list[list[dict[str, str]]]`):
            Conversational completions (the first message's `content` is graded); plain strings are accepted too.
        solution (`list[str]`):
            Reference solutions, one per completion.
        reasoning_delimiters (`list[str]` or `None`, defaults to `None`):
            Strings that end the reasoning, tried in order. `None` means `["</think>"]`.
        log_extra (`Callable[[str, list], None]` or `None`, defaults to `None`):
            When given, logs the columns `solution`, `gold_parsed` and `answer_parsed`.
        **kwargs:
            Other reward-function arguments, ignored.

    Returns:
        `list[float | None]`: One reward per completion.

    Example:
    ```python
    >>> from trl.rewards import reasoning_accuracy_reward
    >>> completions = [[{"role": "assistant", "content": r"<think>1/3 it is</think> $\boxed{\frac{1}{3}}$"}]]
    >>> reasoning_accuracy_reward(completions, [r"\frac{1}{3}"])
    [1.0]
    ```
    """
    _require_math_verify()
    delimiters = reasoning_delimiters if reasoning_delimiters is not None else ["</think>"]
    rewards, golds, answers = [], [], []
    for completion, sol in zip(completions, solution, strict=True):
        text = _content(completion)
        answer_text = None
        for delimiter in delimiters:
            if delimiter in text:
                answer_text = text.split(delimiter, 1)[1]
                break
        if answer_text is None:
            rewards.append(0.0)
            golds.append("[skipped]")
            answers.append("[incomplete reasoning]")
            continue
        reward, gold, answer = _grade(answer_text, sol)
        rewards.append(reward)
        golds.append(gold)
        answers.append(answer)
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)
    return rewards

"""Rewards that check the layout of a completion."""

import re


# One opening <think> at the very start (and no second one), a closing </think>, then anything.
_THINK_PATTERN = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def _content(completion) -> str:
    """Text of a completion: conversational (`[{"role": "assistant", "content": ...}]`) or plain string."""
    if isinstance(completion, str):
        return completion
    return completion[0]["content"]


def think_format_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    r"""1.0 for completions that open with a single `<think>` block closed by `</think>`, else 0.0.

    The completion must start with `<think>`, contain no second `<think>`, and close the block with `</think>`; any
    text may follow (the answer).

    Args:
        completions (`list[list[dict[str, str]]]`):
            Conversational completions (the first message's `content` is read); plain strings are accepted too.
        **kwargs:
            Other reward-function arguments, ignored.

    Returns:
        `list[float]`: One reward per completion.

    Example:
    ```python
    >>> from trl.rewards import think_format_reward
    >>> completions = [
    ...     [{"role": "assistant", "content": "<think>\nSimple.\n</think>\nThe answer is 4."}],
    ...     [{"role": "assistant", "content": "The answer is 4."}],
    ... ]
    >>> think_format_reward(completions)
    [1.0, 0.0]
    ```
    """
    return [1.0 if _THINK_PATTERN.match(_content(completion)) else 0.0 for completion in completions]

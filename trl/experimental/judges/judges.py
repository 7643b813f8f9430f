"""Judges: objects that grade or compare completions, used to rank samples online and to measure win rates.

Four abstract bases fix the calling conventions, and a few ready-made judges implement them:

- `BaseRankJudge`: orders any number of completions per prompt.
- `BasePairwiseJudge`: picks the better of two completions per prompt (`0` or `1`, `-1` when no valid verdict).
- `BaseBinaryJudge`: passes (`1`) or fails (`0`) each completion, `-1` when unknown.
- `PairRMJudge` (local PairRM ranker, needs `llm-blender`), `HfPairwiseJudge` (a chat model behind a Hugging Face
  inference endpoint), `OpenAIPairwiseJudge` (an OpenAI chat model) and `AllTrueJudge` (logical AND of binary judges).
"""

from __future__ import annotations

import logging
import random
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...import_utils import is_llm_blender_available, is_openai_available


logger = logging.getLogger(__name__)


DEFAULT_PAIRWISE_SYSTEM_PROMPT = '''You are a careful evaluator comparing the answers of two AI assistants.

Below is an instruction followed by two candidate outputs, labelled 0 and 1. Decide which output follows the \
instruction better: judge helpfulness, correctness, relevance and clarity, and ignore the order in which the outputs \
are shown as well as their length, unless length matters for the instruction.

## Instruction

{{
    "instruction": """{prompt}""",
}}

## Candidate outputs

{{
    {{
        "model_identifier": "0",
        "output": """{response0}"""
    }},
    {{
        "model_identifier": "1",
        "output": """{response1}"""
    }}
}}

## Your answer

Reply with the identifier of the better output and nothing else: the single character 0 or 1.
'''


class _MissingDependencyError(ImportError, ValueError):
    """An optional dependency is missing.

    It is both an `ImportError` (what it is) and a `ValueError` (what earlier releases raised), so code catching either
    keeps working.
    """


# ---------------------------------------------------------------------------------------------------------------------
# Abstract bases
# ---------------------------------------------------------------------------------------------------------------------


class BaseJudge(ABC):
    """Base class of judges that do not fit the rank, pairwise or binary conventions.

    Subclasses implement `judge`, which receives one prompt per completion and returns one verdict per prompt.
    """

    @abstractmethod
    def judge(self, prompts: list[str], completions: list[str], shuffle_order: bool = True) -> list:
        """Grade `completions[i]` as an answer to `prompts[i]` for every `i`.

        Args:
            prompts (`list[str]`):
                Prompts.
            completions (`list[str]`):
                One completion per prompt.
            shuffle_order (`bool`, *optional*, defaults to `True`):
                Whether to present inputs in a random order, to cancel position biases of the judge.

        Returns:
            `list`: One verdict per prompt.
        """
        raise NotImplementedError("Judge subclasses must implement the `judge` method.")


class BaseRankJudge(ABC):
    """Base class of judges that rank several completions per prompt.

    Example:

    ```python
    class LengthRankJudge(BaseRankJudge):
        # Prefers shorter completions.
        def judge(self, prompts, completions, shuffle_order=True):
            return [sorted(range(len(group)), key=lambda i: len(group[i])) for group in completions]
    ```
    """

    @abstractmethod
    def judge(self, prompts: list[str], completions: list[list[str]], shuffle_order: bool = True) -> list[list[int]]:
        """Rank the completions of every prompt.

        Args:
            prompts (`list[str]`):
                Prompts.
            completions (`list[list[str]]`):
                For each prompt, the candidate completions.
            shuffle_order (`bool`, *optional*, defaults to `True`):
                Whether to present the candidates in a random order, to cancel position biases of the judge.

        Returns:
            `list[list[int]]`: For each prompt, the indices of its completions from best to worst. For example
            `[[2, 0, 1]]` means that the third completion is the best and the second one the worst.
        """
        raise NotImplementedError("Judge subclasses must implement the `judge` method.")


class BasePairwiseJudge(BaseJudge):
    """Base class of judges that pick the better of two completions per prompt.

    Example:

    ```python
    class ShorterIsBetterJudge(BasePairwiseJudge):
        def judge(self, prompts, completions, shuffle_order=True):
            return [0 if len(first) <= len(second) else 1 for first, second in completions]
    ```
    """

    @abstractmethod
    def judge(self, prompts: list[str], completions: list[list[str]], shuffle_order: bool = True) -> list[int]:
        """Pick the better completion of each pair.

        Args:
            prompts (`list[str]`):
                Prompts.
            completions (`list[list[str]]`):
                For each prompt, a pair `[completion_0, completion_1]`.
            shuffle_order (`bool`, *optional*, defaults to `True`):
                Whether to show each pair to the judge in a random order (the returned indices always refer to the
                order given here).

        Returns:
            `list[int]`: For each prompt, `0` or `1`, the index of the better completion, or `-1` when the judge
            gave no valid verdict (malformed answer, request budget spent, ...). Callers must handle `-1`.
        """
        raise NotImplementedError("Judge subclasses must implement the `judge` method.")


class BaseBinaryJudge(BaseJudge):
    """Base class of judges that pass or fail each completion, for example against a constraint or a gold answer."""

    @abstractmethod
    def judge(
        self,
        prompts: list[str],
        completions: list[str],
        gold_completions: list[str] | None = None,
        shuffle_order: bool = True,
    ) -> list[int]:
        """Decide whether each completion satisfies the judge's criterion.

        Args:
            prompts (`list[str]`):
                Prompts.
            completions (`list[str]`):
                One completion per prompt.
            gold_completions (`list[str]`, *optional*):
                Reference answers, for judges that compare against one.
            shuffle_order (`bool`, *optional*, defaults to `True`):
                Whether to shuffle inputs, for judges whose verdict may depend on the order.

        Returns:
            `list[int]`: For each prompt, `1` when the completion passes, `0` when it fails and `-1` when the judge
            could not decide.
        """
        raise NotImplementedError("Judge subclasses must implement the `judge` method.")


# ---------------------------------------------------------------------------------------------------------------------
# Shared pairwise machinery
# ---------------------------------------------------------------------------------------------------------------------


def _check_pairs(judge_name: str, prompts: Sequence[str], completions: Sequence[Sequence[str]]) -> None:
    """Raise a ValueError unless there is exactly one pair of completions per prompt."""
    if len(prompts) != len(completions):
        raise ValueError(
            f"{judge_name} needs one pair of completions per prompt, but got {len(prompts)} prompts and "
            f"{len(completions)} completion pairs. Pass lists of the same length."
        )
    for index, pair in enumerate(completions):
        if isinstance(pair, str) or len(pair) != 2:
            found = "a string" if isinstance(pair, str) else f"{len(pair)} completions"
            raise ValueError(
                f"{judge_name} compares exactly two completions per prompt, but completions[{index}] is {found}. "
                "Pass a list of pairs `[[completion_0, completion_1], ...]`."
            )


def _draw_flips(num_pairs: int, shuffle_order: bool) -> list[bool]:
    """Per pair, whether to show the two completions swapped (a fair coin each when shuffling)."""
    if not shuffle_order:
        return [False] * num_pairs
    return [random.random() < 0.5 for _ in range(num_pairs)]


def _unflip(winner: int, flipped: bool) -> int:
    """Map a verdict about a possibly swapped pair back to the caller's order; `-1` stays `-1`."""
    if winner == -1 or not flipped:
        return winner
    return 1 - winner


def _parse_index_reply(reply: str | None, judge_name: str) -> int:
    """Read a `"0"` / `"1"` reply of a chat model; anything else is an invalid verdict (`-1`)."""
    answer = (reply or "").strip()
    if answer in ("0", "1"):
        return int(answer)
    logger.debug(
        "%s: the judge model replied %r instead of '0' or '1'; counting the verdict as invalid.", judge_name, reply
    )
    return -1


def _judge_pairs_with_chat_model(
    judge_name: str,
    system_prompt: str,
    ask: Callable[[str], str | None],
    prompts: list[str],
    completions: list[list[str]],
    shuffle_order: bool,
) -> list[int]:
    """Ask a chat model for the better completion of each pair, in parallel, undoing the random swaps."""
    flips = _draw_flips(len(prompts), shuffle_order)

    def verdict(prompt: str, pair: Sequence[str], flipped: bool) -> int:
        first, second = (pair[1], pair[0]) if flipped else (pair[0], pair[1])
        content = system_prompt.format(prompt=prompt, response0=first, response1=second)
        return _unflip(_parse_index_reply(ask(content), judge_name), flipped)

    if not prompts:
        return []
    # Network-bound requests: threads overlap the waiting time.
    with ThreadPoolExecutor(max_workers=min(32, len(prompts))) as executor:
        return list(executor.map(verdict, prompts, completions, flips))


# ---------------------------------------------------------------------------------------------------------------------
# Pairwise judges
# ---------------------------------------------------------------------------------------------------------------------


class PairRMJudge(BasePairwiseJudge):
    """Pairwise judge backed by the PairRM ranker ([llm-blender](https://github.com/yuchenlin/LLM-Blender)).

    PairRM is a small model trained to compare two responses to the same instruction. It runs locally, on the
    accelerator of the current process. `llm-blender` must be installed (`pip install llm-blender`) and, as it is not
    compatible with transformers 5, a transformers version below 5 is required.

    Raises:
        ValueError: (also an `ImportError`) when `llm-blender` is not installed.
        RuntimeError: when the installed transformers is version 5 or newer.

    Example:

    ```python
    from trl.experimental.judges import PairRMJudge

    judge = PairRMJudge()
    judge.judge(prompts=["2 + 2 = ?"], completions=[["4", "5"]])  # [0]
    ```
    """

    def __init__(self):
        if not is_llm_blender_available():
            raise _MissingDependencyError(
                "PairRMJudge needs the `llm-blender` package, which is not installed. Install it with "
                "`pip install llm-blender` (it requires transformers<5)."
            )
        import transformers
        from packaging import version

        if version.parse(transformers.__version__).major >= 5:
            raise RuntimeError(
                f"PairRMJudge relies on `llm-blender`, which does not work with transformers>=5, but transformers "
                f"{transformers.__version__} is installed. Use a transformers<5 environment, or another judge such as "
                "HfPairwiseJudge or OpenAIPairwiseJudge."
            )
        import llm_blender
        from accelerate import Accelerator

        self.blender = llm_blender.Blender()
        self.blender.loadranker("llm-blender/PairRM", device=Accelerator().device)

    def judge(
        self,
        prompts: list[str],
        completions: list[list[str]],
        shuffle_order: bool = True,
        return_scores: bool = False,
        temperature: float = 1.0,
    ) -> list[int | float]:
        """Pick the better completion of each pair with PairRM.

        Args:
            prompts (`list[str]`):
                Prompts.
            completions (`list[list[str]]`):
                For each prompt, a pair `[completion_0, completion_1]`.
            shuffle_order (`bool`, *optional*, defaults to `True`):
                Whether to show each pair to the ranker in a random order (undone in the result).
            return_scores (`bool`, *optional*, defaults to `False`):
                Return, instead of indices, the probability that the first completion is the better one:
                `softmax(scores / temperature)[0]` of PairRM's two scores.
            temperature (`float`, *optional*, defaults to `1.0`):
                Temperature applied to the scores when `return_scores=True`.

        Returns:
            `list[int]` of winning indices (`0` or `1`), or `list[float]` of probabilities with `return_scores=True`.
        """
        _check_pairs(type(self).__name__, prompts, completions)
        if return_scores and temperature <= 0:
            raise ValueError(f"`temperature` must be positive, got {temperature}.")
        if not prompts:
            return []
        import numpy as np

        flips = _draw_flips(len(prompts), shuffle_order)
        shown = [[pair[1], pair[0]] if flipped else [pair[0], pair[1]] for pair, flipped in zip(completions, flips)]
        result = np.asarray(
            self.blender.rank(prompts, shown, return_scores=return_scores, disable_tqdm=True), dtype=np.float64
        )

        if return_scores:
            # Put the scores back in the caller's order, then turn them into P(first completion wins).
            scores = np.where(np.asarray(flips)[:, None], result[:, ::-1], result) / temperature
            scores = scores - scores.max(axis=1, keepdims=True)
            probs = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
            return probs[:, 0].tolist()

        # Ranks are 1 (best) and 2: the winner's index in the shown pair is the first completion's rank minus one.
        winners = (result[:, 0] - 1).astype(int).tolist()
        return [_unflip(winner, flipped) for winner, flipped in zip(winners, flips)]


class HfPairwiseJudge(BasePairwiseJudge):
    """Pairwise judge that asks a chat model served through Hugging Face inference (`huggingface_hub.InferenceClient`).

    For every pair the system prompt is filled in (`{prompt}`, `{response0}`, `{response1}`) and sent as one user
    message; the model must answer with a single token, `0` or `1`. Any other answer counts as an invalid verdict
    (`-1`). Requests run in parallel threads.

    Args:
        model (`str`, *optional*, defaults to `"meta-llama/Meta-Llama-3-70B-Instruct"`):
            Model id on the Hub, or the URL of an inference endpoint (for example a local TGI / vLLM server).
        token (`str`, *optional*):
            Hugging Face token; `None` uses the locally saved one.
        system_prompt (`str`, *optional*):
            Prompt template with the placeholders `{prompt}`, `{response0}` and `{response1}` (literal braces must be
            doubled). `None` uses `DEFAULT_PAIRWISE_SYSTEM_PROMPT`.

    Example:

    ```python
    from trl.experimental.judges import HfPairwiseJudge

    judge = HfPairwiseJudge()
    judge.judge(
        prompts=["What is the capital of France?"],
        completions=[["Paris", "Lyon"]],
    )  # [0]
    ```
    """

    def __init__(
        self,
        model: str = "meta-llama/Meta-Llama-3-70B-Instruct",
        token: str | None = None,
        system_prompt: str | None = None,
    ):
        from huggingface_hub import InferenceClient

        self.client = InferenceClient(model=model, token=token)
        self.system_prompt = system_prompt or DEFAULT_PAIRWISE_SYSTEM_PROMPT

    def _ask(self, content: str) -> str | None:
        response = self.client.chat_completion(messages=[{"role": "user", "content": content}], max_tokens=1)
        return response.choices[0].message.content

    def judge(self, prompts: list[str], completions: list[list[str]], shuffle_order: bool = True) -> list[int]:
        """Pick the better completion of each pair (see `BasePairwiseJudge.judge`); `-1` for malformed answers."""
        _check_pairs(type(self).__name__, prompts, completions)
        return _judge_pairs_with_chat_model(
            type(self).__name__, self.system_prompt, self._ask, prompts, completions, shuffle_order
        )


class OpenAIPairwiseJudge(BasePairwiseJudge):
    """Pairwise judge that asks an OpenAI chat model (or any server speaking the chat-completions protocol).

    Works like `HfPairwiseJudge` through the `openai` client (`pip install openai`), which reads the usual
    `OPENAI_API_KEY` and `OPENAI_BASE_URL` environment variables. Every compared pair is one request; to cap the
    cost, at most `max_requests` requests are sent over the judge's lifetime: once the budget is spent, the remaining
    pairs get `-1` and a warning is emitted (once).

    Args:
        model (`str`, *optional*, defaults to `"gpt-4-turbo-preview"`):
            Chat model name.
        system_prompt (`str`, *optional*):
            Prompt template with the placeholders `{prompt}`, `{response0}` and `{response1}` (literal braces must be
            doubled). `None` uses `DEFAULT_PAIRWISE_SYSTEM_PROMPT`.
        max_requests (`int` or `None`, *optional*, defaults to `1000`):
            Maximum number of requests; `None` removes the limit.

    Raises:
        ValueError: (also an `ImportError`) when `openai` is not installed.

    Example:

    ```python
    from trl.experimental.judges import OpenAIPairwiseJudge

    judge = OpenAIPairwiseJudge(model="gpt-4o-mini", max_requests=100)
    judge.judge(prompts=["2 + 2 = ?"], completions=[["5", "4"]])  # [1]
    ```
    """

    def __init__(
        self,
        model: str = "gpt-4-turbo-preview",
        system_prompt: str | None = None,
        max_requests: int | None = 1_000,
    ):
        if not is_openai_available():
            raise _MissingDependencyError(
                "OpenAIPairwiseJudge needs the `openai` package, which is not installed. Install it with "
                "`pip install openai` (or `pip install trl[judges]`)."
            )
        if max_requests is not None and max_requests < 0:
            raise ValueError(f"`max_requests` must be a non-negative integer or None (no limit), got {max_requests}.")
        from openai import OpenAI

        self.client = OpenAI()
        self.model = model
        self.system_prompt = system_prompt or DEFAULT_PAIRWISE_SYSTEM_PROMPT
        self.max_requests = max_requests
        self.num_requests = 0
        self._warned_budget = False

    def _ask(self, content: str) -> str | None:
        response = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": content}], max_tokens=1
        )
        return response.choices[0].message.content

    def judge(self, prompts: list[str], completions: list[list[str]], shuffle_order: bool = True) -> list[int]:
        """Pick the better completion of each pair (see `BasePairwiseJudge.judge`).

        Pairs beyond the request budget and malformed answers get `-1`.
        """
        _check_pairs(type(self).__name__, prompts, completions)
        num_allowed = len(prompts)
        if self.max_requests is not None:
            num_allowed = max(0, min(num_allowed, self.max_requests - self.num_requests))
        if num_allowed < len(prompts) and not self._warned_budget:
            warnings.warn(
                f"OpenAIPairwiseJudge reached its budget of {self.max_requests} requests: the remaining pairs get "
                "-1 (no verdict). Create the judge with a larger `max_requests`, or `max_requests=None` for no limit.",
                stacklevel=2,
            )
            self._warned_budget = True

        verdicts = _judge_pairs_with_chat_model(
            type(self).__name__,
            self.system_prompt,
            self._ask,
            prompts[:num_allowed],
            completions[:num_allowed],
            shuffle_order,
        )
        self.num_requests += num_allowed
        return verdicts + [-1] * (len(prompts) - num_allowed)


# ---------------------------------------------------------------------------------------------------------------------
# Binary judges
# ---------------------------------------------------------------------------------------------------------------------


class AllTrueJudge(BaseBinaryJudge):
    """Binary judge that passes a completion only when every one of its judges passes it.

    Per completion: `-1` if any judge returned `-1`, else `1` if all returned `1`, else `0`. Useful to combine
    several constraints (format, length, correctness, ...) into one verdict.

    Args:
        judges (`list[BaseBinaryJudge]`):
            Binary judges to combine; each is called with the same arguments.

    Example:

    ```python
    from trl.experimental.judges import AllTrueJudge, BaseBinaryJudge


    class NonEmptyJudge(BaseBinaryJudge):
        def judge(self, prompts, completions, gold_completions=None, shuffle_order=True):
            return [int(bool(c.strip())) for c in completions]


    class ShortJudge(BaseBinaryJudge):
        def judge(self, prompts, completions, gold_completions=None, shuffle_order=True):
            return [int(len(c) < 20) for c in completions]


    AllTrueJudge([NonEmptyJudge(), ShortJudge()]).judge(["q", "q"], ["ok", ""])  # [1, 0]
    ```
    """

    def __init__(self, judges: list[BaseBinaryJudge]):
        if not judges:
            raise ValueError("AllTrueJudge needs at least one judge, but `judges` is empty. Pass a list of judges.")
        self.judges = judges

    def judge(
        self,
        prompts: list[str],
        completions: list[str],
        gold_completions: list[str] | None = None,
        shuffle_order: bool = True,
    ) -> list[int]:
        """Combine the verdicts of all judges (see the class docstring)."""
        all_verdicts: list[list[Any]] = []
        for judge in self.judges:
            verdicts = list(judge.judge(prompts, completions, gold_completions, shuffle_order))
            if len(verdicts) != len(prompts):
                raise ValueError(
                    f"AllTrueJudge: {type(judge).__name__} returned {len(verdicts)} verdicts for {len(prompts)} "
                    "prompts. Every judge must return one verdict per prompt."
                )
            all_verdicts.append(verdicts)

        combined = []
        for index, verdicts in enumerate(zip(*all_verdicts)):
            for judge, verdict in zip(self.judges, verdicts):
                if verdict not in (0, 1, -1):
                    raise ValueError(
                        f"AllTrueJudge: {type(judge).__name__} returned {verdict!r} for prompt {index}; binary judges "
                        "must return 0 (fail), 1 (pass) or -1 (unknown)."
                    )
            if -1 in verdicts:
                combined.append(-1)
            elif all(verdict == 1 for verdict in verdicts):
                combined.append(1)
            else:
                combined.append(0)
        return combined

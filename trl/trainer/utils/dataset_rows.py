"""Turning dataset rows into model inputs.

The offline preference trainers (DPO, KTO, BCO, ...) tokenize a prompt together with one completion (KTO, BCO) or
two (DPO), standard text or conversational messages rendered by the chat template, and split each sequence into
its prompt part and its completion part. They also share a few bookkeeping helpers: collation into padded batches,
the number of completion tokens that survive truncation, `Dataset.map` keyword handling, and dropping the `None`
fields Arrow fills into rows.
"""

import json
from collections.abc import Sequence
from typing import Any

import torch

from .tensors import pad


def check_truncation_mode(truncation_mode: str) -> None:
    """Raise TRL's error for a `truncation_mode` other than `"keep_start"` and `"keep_end"`.

    Args:
        truncation_mode: The configured value.

    Raises:
        ValueError: For any other value (TRL's sentence first, then the accepted values spelled out).
    """
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(
            f"Unsupported truncation mode: {truncation_mode}, expected 'keep_start' or 'keep_end'. Set "
            "truncation_mode='keep_start' (keep the beginning) or 'keep_end' (keep the end)."
        )


def map_kwargs_with_desc(map_kwargs: dict[str, Any], text: str) -> dict[str, Any]:
    """`map_kwargs` plus a progress description (map-style datasets only: `IterableDataset.map` takes no `desc`)."""
    return {**map_kwargs, "desc": text} if "num_proc" in map_kwargs else dict(map_kwargs)


def as_token_list(value: Any) -> list[int]:
    """Token ids from a tokenizer or `apply_chat_template` as a flat list (a `[[...]]` batch of one is unwrapped)."""
    if torch.is_tensor(value):
        value = value.tolist()
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        return value[0]
    return list(value)


def parse_tools_column(tools: Any) -> Any:
    """Value of a `tools` dataset column: a list of JSON schemas, or a JSON string holding one."""
    if isinstance(tools, str):
        try:
            return json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"The `tools` column must hold a list of JSON schemas or a JSON string; got {tools!r}."
            ) from error
    return tools


class PromptCompletionTokenizer:
    """Tokenize a prompt followed by one or more alternative completions, splitting each sequence at the prompt.

    Every `prompt + completion` sequence is tokenized in full and the prompt is taken as the shared token prefix of
    all of them and of the separately tokenized prompt, so a tokenizer that merges characters across the junction
    cannot make the prompt differ between the sequences. Standard (text) completions get the EOS token appended;
    conversational rows are rendered with the chat template (the prompt with the generation prompt, or as a
    continuation when it ends with an assistant message), with the row's optional `tools` and `chat_template_kwargs`.

    Args:
        processing_class: Tokenizer or processor (conversational data needs a chat template).
        conversational: Whether the rows hold message lists.

    Example:
    ```python
    >>> tokenize = PromptCompletionTokenizer(tokenizer, conversational=False)
    >>> prompt_ids, (completion_ids,) = tokenize({}, "The sky is", [" blue"])
    ```
    """

    def __init__(self, processing_class: Any, conversational: bool):
        self.processing_class = processing_class
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.conversational = conversational

    def _chat(self, messages: list[dict[str, Any]], example: dict[str, Any], **kwargs: Any) -> list[int]:
        template_kwargs = {k: v for k, v in (example.get("chat_template_kwargs") or {}).items() if v is not None}
        try:
            out = self.processing_class.apply_chat_template(
                messages,
                tools=parse_tools_column(example.get("tools")),
                tokenize=True,
                return_dict=True,
                **kwargs,
                **template_kwargs,
            )
        except Exception as error:  # surface template errors with the offending example
            raise ValueError(
                f"Applying the chat template failed on the example {str(messages)[:300]}: {error}"
            ) from error
        return as_token_list(out["input_ids"])

    def __call__(
        self,
        example: dict[str, Any],
        prompt: Any,
        completions: Sequence[Any],
        column_names: Sequence[str] = ("prompt", "completion"),
    ) -> tuple[list[int], list[list[int]]]:
        """Return `(prompt_ids, [completion_ids, ...])`, one completion list per entry of `completions`.

        Args:
            example: The dataset row (for its optional `tools` and `chat_template_kwargs`).
            prompt: Prompt text or messages (None or empty for no prompt).
            completions: Completion texts or message lists.
            column_names: Names of the prompt and completion columns, used in error messages.
        """
        if self.conversational:
            prompt = list(prompt or [])
            if prompt:
                last_role = prompt[-1].get("role")
                prompt_kwargs = (
                    {"continue_final_message": True} if last_role == "assistant" else {"add_generation_prompt": True}
                )
                prompt_ids = self._chat(prompt, example, **prompt_kwargs)
            else:
                prompt_ids = []
            full = [self._chat(prompt + list(completion), example) for completion in completions]
        else:
            prompt = prompt or ""
            if not all(isinstance(value, str) for value in (prompt, *completions)):
                found = ", ".join(type(value).__name__ for value in (prompt, *completions))
                raise ValueError(
                    f"Standard (text) data needs string values in the columns {list(column_names)}; got {found}. "
                    "Conversational data must be lists of {'role', 'content'} messages in every column."
                )
            eos = self.tokenizer.eos_token
            if eos:
                completions = [c if c.endswith(eos) else c + eos for c in completions]
            prompt_ids = as_token_list(self.tokenizer(prompt)["input_ids"]) if prompt else []
            full = [as_token_list(self.tokenizer(prompt + completion)["input_ids"]) for completion in completions]
        from ...data_utils import common_prefix_length

        split = min(common_prefix_length(prompt_ids, ids) for ids in full)
        return full[0][:split], [ids[split:] for ids in full]


def scored_completion_tokens(
    prompt_length: int, completion_length: int, max_length: int | None, truncation_mode: str = "keep_start"
) -> int:
    """Completion tokens of a `prompt + completion` sequence still scored after truncation to `max_length`.

    `keep_start` keeps the first `max_length` tokens, `keep_end` the last ones. The first token of a sequence has
    nothing before it, so it is never scored.
    """
    total = prompt_length + completion_length
    if max_length is None or total <= max_length:
        kept_prompt, kept_completion = prompt_length, completion_length
    elif truncation_mode == "keep_start":
        kept_prompt = min(prompt_length, max_length)
        kept_completion = max_length - kept_prompt
    else:
        kept_completion = min(completion_length, max_length)
        kept_prompt = max_length - kept_completion
    return kept_completion - (1 if kept_prompt == 0 and kept_completion > 0 else 0)


def collate_prompt_completions(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_token_id: int,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded batch of the token sequences `prompt + completion` (the core of the preference collators).

    Args:
        prompts: Prompt token ids, one list per sequence.
        completions: Completion token ids, aligned with `prompts`.
        pad_token_id: Token used to pad `input_ids`.
        max_length: Keep at most this many tokens of each sequence (`None`: no truncation).
        truncation_mode: `"keep_start"` keeps the first `max_length` tokens, `"keep_end"` the last ones.
        pad_to_multiple_of: Pad the sequence length to a multiple of this value.

    Returns:
        `input_ids`, `attention_mask` and `completion_mask` (1 on completion tokens), each `(n, T)`.

    Example:
    ```python
    >>> collate_prompt_completions([[1, 2], [1]], [[3], [4, 5]], pad_token_id=0)["completion_mask"]
    tensor([[0, 0, 1],
            [0, 1, 1]])
    ```
    """
    check_truncation_mode(truncation_mode)
    sequences, masks = [], []
    for prompt, completion in zip(prompts, completions):
        ids = list(prompt) + list(completion)
        mask = [0] * len(prompt) + [1] * len(completion)
        if max_length is not None and len(ids) > max_length:
            kept = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            ids, mask = ids[kept], mask[kept]
        sequences.append(torch.tensor(ids, dtype=torch.long))
        masks.append(torch.tensor(mask, dtype=torch.long))
    return {
        "input_ids": pad(sequences, pad_token_id, "right", pad_to_multiple_of),
        "attention_mask": pad([torch.ones_like(s) for s in sequences], 0, "right", pad_to_multiple_of),
        "completion_mask": pad(masks, 0, "right", pad_to_multiple_of),
    }


def remove_none_values(example: Any) -> Any:
    """Recursively drop dictionary entries whose value is None (lists are processed item by item)."""
    if isinstance(example, dict):
        return {k: remove_none_values(v) for k, v in example.items() if v is not None}
    if isinstance(example, list):
        return [remove_none_values(v) for v in example]
    return example

"""BCO's dataset columns (TRL 1.12's `prompt_input_ids`, `completion_labels`, ...) and the collator wrappers that
read them and add UDM's per-example weights."""

from collections.abc import Callable
from typing import Any

import torch

from ...data_utils import is_conversational, maybe_apply_chat_template


# Per-example weight column added by UDM (1.0 for desirable examples).
_UDM_COLUMN = "udm_weight"
_BCO_TOKEN_COLUMNS = (
    "prompt_input_ids",
    "prompt_attention_mask",
    "answer_input_ids",
    "answer_attention_mask",
    "completion_input_ids",
    "completion_attention_mask",
    "completion_labels",
)
# Label of the prompt positions in `completion_labels`.
_IGNORED_LABEL = -100


class _ToBCOColumns:
    """Turn a tokenized example (`prompt_ids`, `completion_ids`) into TRL 1.12's BCO columns (a picklable
    `Dataset.map` function).

    `answer_input_ids` is the tokenized completion, `completion_input_ids` the prompt followed by the completion ended
    with EOS (also after a chat template's closing newline, as TRL's BCO does) and cut to `max_completion_length`
    completion tokens, `completion_labels` the same with the prompt positions set to -100. A conversational example's
    raw `prompt` / `completion` become the rendered chat-template text, as in TRL.
    """

    def __init__(self, processing_class: Any, eos_token_id: int | None, max_completion_length: int | None):
        self.processing_class = processing_class
        self.eos_token_id = eos_token_id
        self.max_completion_length = max_completion_length

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        prompt = list(example["prompt_ids"])
        completion = list(example["completion_ids"])
        # Text completions are tokenized with EOS already; a chat-templated one is not.
        ends_with_eos = self.eos_token_id is not None and completion[-1:] == [self.eos_token_id]
        answer = completion[:-1] if ends_with_eos else completion
        if self.eos_token_id is not None and not ends_with_eos:
            completion = completion + [self.eos_token_id]
        if self.max_completion_length is not None:
            completion = completion[: self.max_completion_length]
        out: dict[str, Any] = {}
        if is_conversational({key: example[key] for key in ("prompt", "completion") if key in example}):
            rendered = maybe_apply_chat_template(
                {"prompt": example["prompt"], "completion": example["completion"]}, self.processing_class
            )
            out.update(prompt=rendered["prompt"], completion=rendered["completion"])
        out.update(
            prompt_input_ids=prompt,
            prompt_attention_mask=[1] * len(prompt),
            answer_input_ids=answer,
            answer_attention_mask=[1] * len(answer),
            completion_input_ids=prompt + completion,
            completion_attention_mask=[1] * (len(prompt) + len(completion)),
            completion_labels=[_IGNORED_LABEL] * len(prompt) + completion,
        )
        return out


class _FromBCOColumns:
    """Collator wrapper that feeds TRL's BCO columns (`prompt_input_ids`, `completion_input_ids`, ...) to a collator
    of `prompt_ids` / `completion_ids` examples."""

    def __init__(self, collator: Callable):
        self.collator = collator

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        converted = []
        for example in examples:
            if "prompt_ids" not in example:
                example = dict(example)
                prompt = example["prompt_input_ids"]
                example["prompt_ids"] = prompt
                example["completion_ids"] = example["completion_input_ids"][len(prompt) :]
            converted.append(example)
        return self.collator(converted)


class _WithUDMWeights:
    """Collator wrapper that adds the per-example `udm_weight` column to the batch."""

    def __init__(self, collator: Callable):
        self.collator = collator

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.collator(examples)
        if examples and all(example.get(_UDM_COLUMN) is not None for example in examples):
            batch[_UDM_COLUMN] = torch.tensor([float(example[_UDM_COLUMN]) for example in examples])
        return batch

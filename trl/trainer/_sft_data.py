"""Dataset-map functions of SFTTrainer's data preparation (module-level classes so `dataset_num_proc` can pickle
them): EOS appending, tokenization, labels, truncation."""

import logging
from typing import Any

import torch
from datasets import Dataset

from .._compat import processor_chat_template_target
from ..data_utils import common_prefix_length
from .utils.dataset_rows import parse_tools_column


logger = logging.getLogger("trl.trainer.sft_trainer")


class _AppendEOS:
    """Appends the EOS token to a text column unless the value already ends with it."""

    def __init__(self, field: str, eos_token: str):
        self.field = field
        self.eos_token = eos_token

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        value = example[self.field]
        if isinstance(value, str) and not value.endswith(self.eos_token):
            return {self.field: value + self.eos_token}
        return {}


class _Tokenizer:
    """Turns one raw example into `input_ids` (+ `completion_mask` / `assistant_masks`)."""

    def __init__(
        self, processing_class, data_format, conversational, text_field, assistant_only_loss, chat_template=None
    ):
        self.processing_class = processing_class
        # A training variant of the chat template (with generation markers) used instead of the tokenizer's own.
        self.chat_template = chat_template
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self.data_format = data_format
        self.conversational = conversational
        self.text_field = text_field
        self.assistant_only_loss = assistant_only_loss

    def output_columns(self) -> list[str]:
        columns = ["input_ids"]
        if self.data_format == "prompt_completion":
            columns.append("completion_mask")
        if self.assistant_only_loss:
            columns.append("assistant_masks")
        return columns

    def _chat(self, messages, example, **kwargs) -> dict[str, list[int]]:
        tools = parse_tools_column(example.get("tools"))
        template_kwargs = dict(example.get("chat_template_kwargs") or {})
        target, target_kwargs = processor_chat_template_target(self.processing_class, messages)
        template_kwargs = {**target_kwargs, **template_kwargs}
        if self.chat_template is not None:
            template_kwargs["chat_template"] = self.chat_template
        try:
            out = target.apply_chat_template(
                messages, tools=tools, tokenize=True, return_dict=True, **kwargs, **template_kwargs
            )
        except Exception as error:  # surface template errors with the offending example
            raise ValueError(
                f"Applying the chat template failed on the example {str(messages)[:300]}: {error}"
            ) from error
        return {key: _as_list(value) for key, value in out.items()}

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        if self.data_format == "prompt_completion":
            prompt, completion = example["prompt"], example["completion"]
            if self.conversational:
                last_role = prompt[-1]["role"] if prompt else "user"
                prompt_kwargs = (
                    {"continue_final_message": True} if last_role == "assistant" else {"add_generation_prompt": True}
                )
                prompt_ids = self._chat(prompt, example, **prompt_kwargs)["input_ids"]
                full = self._chat(prompt + completion, example, return_assistant_tokens_mask=self.assistant_only_loss)
            else:
                if not isinstance(prompt, str) or not isinstance(completion, str):
                    raise ValueError(
                        "Standard prompt-completion data needs string `prompt` and `completion` values; got "
                        f"{type(prompt).__name__} and {type(completion).__name__}."
                    )
                prompt_ids = _as_list(self.tokenizer(prompt)["input_ids"])
                full = {"input_ids": _as_list(self.tokenizer(prompt + completion)["input_ids"])}
            input_ids = full["input_ids"]
            split = common_prefix_length(prompt_ids, input_ids)
            if split != len(prompt_ids):
                logger.debug("Prompt tokens changed when the completion was appended; splitting at the common prefix.")
            output = {"input_ids": input_ids, "completion_mask": [0] * split + [1] * (len(input_ids) - split)}
            if self.assistant_only_loss:
                output["assistant_masks"] = full["assistant_masks"]
            return output

        if self.data_format == "messages":
            out = self._chat(example["messages"], example, return_assistant_tokens_mask=self.assistant_only_loss)
            output = {"input_ids": out["input_ids"]}
            if self.assistant_only_loss:
                output["assistant_masks"] = out["assistant_masks"]
            return output

        text = example[self.text_field]
        if not isinstance(text, str):
            raise ValueError(
                f"Column {self.text_field!r} must hold strings; found {type(text).__name__}. Point dataset_text_field "
                "at a text column or pass a formatting_func."
            )
        return {"input_ids": _as_list(self.tokenizer(text)["input_ids"])}


class _LabelBuilder:
    """`labels` from `input_ids`: -100 outside the completion (`completion_mask`, when `completion_only`) and outside
    the assistant turns (`assistant_masks`, whenever present)."""

    def __init__(self, completion_only: bool):
        self.completion_only = completion_only

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        labels = list(example["input_ids"])
        if self.completion_only and example.get("completion_mask") is not None:
            labels = [label if keep else -100 for label, keep in zip(labels, example["completion_mask"])]
        masks = example.get("assistant_masks")
        if masks is not None:  # an all-zero mask leaves nothing to train on: the row is dropped afterwards
            labels = [label if keep else -100 for label, keep in zip(labels, masks)]
        return {"labels": labels}


class _Truncator:
    def __init__(self, max_length: int | None, mode: str):
        self.max_length = max_length
        self.mode = mode

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        if self.max_length is None or len(example["input_ids"]) <= self.max_length:
            return {}
        out = {}
        for key in ("input_ids", "labels", "completion_mask", "assistant_masks"):
            if example.get(key) is not None:
                values = example[key]
                out[key] = values[: self.max_length] if self.mode == "keep_start" else values[-self.max_length :]
        return out


def _shortest_prompt(dataset: Dataset) -> int | None:
    """Length of the shortest run of leading -100 labels (the masked prompt), None when no row starts masked."""
    lengths = [next((i for i, label in enumerate(labels) if label != -100), None) for labels in dataset["labels"]]
    lengths = [n for n in lengths if n is not None]
    return min(lengths) if lengths and min(lengths) > 0 else None


def _as_list(value: Any) -> Any:
    if torch.is_tensor(value):
        value = value.tolist()
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        return value[0]
    return value

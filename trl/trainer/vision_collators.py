"""Collators for datasets with images: rows are rendered and processed by the model's processor at batch time.

Vision datasets are not tokenized ahead of time (the pixel values would not fit in Arrow columns cheaply), so each
collator renders the chat template, runs the processor on the prompts and their images, appends the tokenized
completions, truncates (never inside an image's tokens) and pads. Re-exported by the trainer modules:
`trl.trainer.sft_trainer.DataCollatorForVisionLanguageModeling`, `trl.trainer.dpo_trainer.DataCollatorForVisionPreference`
and `trl.trainer.kto_trainer.DataCollatorForVisionUnpairedPreference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._compat import process_images
from ..data_utils import apply_chat_template, is_conversational, prepare_multimodal_messages
from .utils.tensors import pad
from .utils.vision import example_images, image_token_id


# Keys of a processor's output that hold one value per token (extended over completions and padded like input_ids).
_TOKEN_LEVEL_KEYS = ("mm_token_type_ids", "token_type_ids")


def _with_images(example: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """Conversational columns with typed content and the row's images attached to their placeholders."""
    images = example_images(example)
    out = dict(example)
    first = True
    for key in keys:
        if key in example and isinstance(example[key], list):
            # Only the first message list (the prompt, or the whole conversation) receives the images.
            out[key] = prepare_multimodal_messages(example[key], images if first else [])
            first = False
    return out


def _render(example: dict[str, Any], processor: Any, keys: tuple[str, ...], chat_template: str | None) -> dict:
    """Strings of the text columns: conversational rows go through the chat template, standard ones stay as given."""
    if not is_conversational(example):
        return {key: example[key] for key in keys if key in example}
    rows = _with_images(example, keys)
    columns = {key: rows[key] for key in keys if key in rows}
    kwargs = {"chat_template": chat_template} if chat_template is not None else {}
    return apply_chat_template(columns, processor, **kwargs)


def _check_image_tokens_kept(ids: list[int], kept: int, image_id: int | None, max_length: int) -> None:
    if image_id is not None and image_id in ids[kept:]:
        raise ValueError(
            f"Truncating this sequence of {len(ids)} tokens to max_length={max_length} would cut through an image's "
            "tokens, which the model cannot process. Raise max_length (or set it to None), use smaller images, or "
            "shorten the text before the image."
        )


class _VisionEncoder:
    """Processor calls shared by the vision collators."""

    def __init__(self, processor: Any, max_length: int | None, pad_to_multiple_of: int | None):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = self.tokenizer.convert_tokens_to_ids(self.tokenizer.pad_token)
        self.image_token_id = image_token_id(processor)

    def process(self, texts: list[str], images: list[list]) -> tuple[list[list[int]], dict[str, list], dict]:
        """Token ids without padding, per-token extras and image tensors of `texts` with their `images`."""
        kwargs = dict(text=texts, padding=True, return_tensors="pt", add_special_tokens=False)
        encoded = process_images(self.processor, images, **kwargs) if any(images) else self.processor(**kwargs)
        mask = encoded["attention_mask"].bool()
        ids = [row[m].tolist() for row, m in zip(encoded["input_ids"], mask)]
        token_level = {
            k: [row[m].tolist() for row, m in zip(encoded[k], mask)] for k in _TOKEN_LEVEL_KEYS if k in encoded
        }
        image_level = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask", *token_level)}
        return ids, token_level, image_level

    def truncate(self, ids: list[int]) -> int:
        """Length to keep of a sequence (`max_length` from the start), checking that no image token is cut."""
        if self.max_length is None or len(ids) <= self.max_length:
            return len(ids)
        _check_image_tokens_kept(ids, self.max_length, self.image_token_id, self.max_length)
        return self.max_length

    def pad_rows(self, rows: list[list[int]], value: int) -> torch.Tensor:
        return pad(
            [torch.tensor(row, dtype=torch.long) for row in rows],
            padding_value=value,
            padding_side="right",
            pad_to_multiple_of=self.pad_to_multiple_of,
        )

    def prompt_completion(
        self, prompts: list[str], completions: list[str], images: list[list], token_level: dict | None = None
    ) -> dict[str, Any]:
        """Padded `prompt + completion` rows with `completion_mask`, per-token extras and the image tensors."""
        prompt_ids, prompt_extras, image_level = self.process(prompts, images)
        completion_ids = self.tokenizer(completions, add_special_tokens=False)["input_ids"]
        rows, completion_mask, extras = [], [], {key: [] for key in prompt_extras}
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            ids = p + c
            kept = self.truncate(ids)
            rows.append(ids[:kept])
            completion_mask.append(([0] * len(p) + [1] * len(c))[:kept])
            for key, values in prompt_extras.items():
                extras[key].append((values[i] + [0] * len(c))[:kept])
        batch = {"input_ids": self.pad_rows(rows, self.pad_token_id)}
        batch["attention_mask"] = self.pad_rows([[1] * len(r) for r in rows], 0)
        for key, values in extras.items():
            batch[key] = self.pad_rows(values, 0)
        batch.update(image_level)
        batch["completion_mask"] = self.pad_rows(completion_mask, 0)
        return batch


def _stack_rows(first: dict[str, Any], second: dict[str, Any], pad_token_id: int) -> dict[str, Any]:
    """Rows of `first` then rows of `second` (padded to a common length); image tensors concatenated."""
    out = {}
    for key, value in first.items():
        other = second[key]
        if key in ("input_ids", "attention_mask", "completion_mask", *_TOKEN_LEVEL_KEYS):
            width = max(value.shape[1], other.shape[1])
            fill = pad_token_id if key == "input_ids" else 0
            value = torch.nn.functional.pad(value, (0, width - value.shape[1]), value=fill)
            other = torch.nn.functional.pad(other, (0, width - other.shape[1]), value=fill)
        out[key] = torch.cat([value, other], dim=0)
    return out


@dataclass
class DataCollatorForVisionLanguageModeling:
    """Collator for vision-language SFT: renders, processes, truncates and pads rows with images.

    Rows hold images under `images` (a list) or `image`, and either conversational `messages`, conversational or
    standard `prompt` + `completion`, or a standard text column (`dataset_text_field`). Image placeholders
    (`{"type": "image"}`) are added to the first user message when its content is a plain string.

    Args:
        processor (`ProcessorMixin`):
            The model's processor (image processor + tokenizer + chat template).
        max_length (`int`, *optional*):
            Keep at most this many tokens from the start; a cut through an image's tokens raises an error.
        completion_only_loss (`bool`, *optional*, defaults to `False`):
            For prompt-completion rows, train on the completion tokens only (`None` behaves like `True`).
        pad_to_multiple_of (`int`, *optional*):
            Pad the sequence length to a multiple of this value.
        dataset_text_field (`str`, *optional*, defaults to `"text"`):
            Column with the text of standard language-modeling rows.
        assistant_only_loss (`bool`, *optional*, defaults to `False`):
            For conversational `messages`, train only on assistant tokens (the template needs generation markers).
        chat_template (`str`, *optional*):
            Template used instead of the processor's.
        return_tensors (`str`, *optional*, defaults to `"pt"`):
            Only `"pt"` is supported.
    """

    processor: Any
    max_length: int | None = None
    completion_only_loss: bool = False
    pad_to_multiple_of: int | None = None
    dataset_text_field: str = "text"
    assistant_only_loss: bool = False
    chat_template: str | None = None
    return_tensors: str = "pt"

    def __post_init__(self):
        self._encoder = _VisionEncoder(self.processor, self.max_length, self.pad_to_multiple_of)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if "messages" in examples[0] or self.dataset_text_field in examples[0]:
            return self._language_modeling(examples)
        if "prompt" in examples[0] and "completion" in examples[0]:
            return self._prompt_completion(examples)
        raise KeyError(
            f"Expected rows with 'messages', {self.dataset_text_field!r} or 'prompt' + 'completion' (plus 'images' or "
            f"'image'), got keys {sorted(examples[0])}."
        )

    def _language_modeling(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if self.completion_only_loss:
            raise ValueError(
                "The `completion_only_loss` argument is not supported for language modeling datasets: there is no "
                "prompt/completion split. Use prompt-completion rows, or assistant_only_loss for conversations."
            )
        encoder = self._encoder
        images = [example_images(example) for example in examples]
        if "messages" in examples[0]:
            messages = [_with_images(example, ("messages",))["messages"] for example in examples]
            kwargs = {"chat_template": self.chat_template} if self.chat_template is not None else {}
            encoded = self.processor.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=self.assistant_only_loss,
                padding=True,
                return_tensors="pt",
                **kwargs,
            )
        else:
            if self.assistant_only_loss:
                raise ValueError(
                    "The `assistant_only_loss` argument is only supported for conversational language modeling "
                    "datasets (a 'messages' column); these rows have a standard text column."
                )
            texts = [example[self.dataset_text_field] for example in examples]
            kwargs = dict(text=texts, padding=True, return_tensors="pt")
            encoded = process_images(self.processor, images, **kwargs) if any(images) else self.processor(**kwargs)
        mask = encoded["attention_mask"].bool()
        rows, labels, extras = [], [], {k: [] for k in _TOKEN_LEVEL_KEYS if k in encoded}
        for i in range(len(examples)):
            ids = encoded["input_ids"][i][mask[i]].tolist()
            kept = encoder.truncate(ids)
            rows.append(ids[:kept])
            if self.assistant_only_loss:
                assistant = encoded["assistant_masks"][i][mask[i]].tolist()
                labels.append([t if a else -100 for t, a in zip(ids[:kept], assistant)])
            else:
                labels.append(ids[:kept])
            for key in extras:
                extras[key].append(encoded[key][i][mask[i]].tolist()[:kept])
        if self.assistant_only_loss and not any(label != -100 for row in labels for label in row):
            raise RuntimeError(
                "assistant_only_loss=True but no token of this batch is marked as an assistant token: the chat "
                "template needs {% generation %} markers around assistant turns."
            )
        batch = {"input_ids": encoder.pad_rows(rows, encoder.pad_token_id)}
        batch["attention_mask"] = encoder.pad_rows([[1] * len(r) for r in rows], 0)
        for key, values in extras.items():
            batch[key] = encoder.pad_rows(values, 0)
        skip = {"input_ids", "attention_mask", "assistant_masks", *extras}
        batch.update({k: v for k, v in encoded.items() if k not in skip})
        batch["labels"] = encoder.pad_rows(labels, -100)
        return batch

    def _prompt_completion(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if self.assistant_only_loss:
            raise ValueError(
                "The `assistant_only_loss` argument is only supported for conversational language modeling datasets "
                "(a 'messages' column); for prompt-completion rows use completion_only_loss."
            )
        rendered = [_render(ex, self.processor, ("prompt", "completion"), self.chat_template) for ex in examples]
        batch = self._encoder.prompt_completion(
            [r["prompt"] for r in rendered],
            [r["completion"] for r in rendered],
            [example_images(example) for example in examples],
        )
        completion_mask = batch.pop("completion_mask")
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        if self.completion_only_loss is not False:  # None (the config default) means "on" for prompt-completion rows
            labels[completion_mask == 0] = -100
        batch["labels"] = labels
        return batch


@dataclass
class DataCollatorForVisionPreference:
    """Collator for vision-language DPO: the chosen rows then the rejected rows, each `prompt + completion`.

    Rows hold `prompt`, `chosen`, `rejected` (conversational or standard) and `images` or `image`. The image tensors
    are repeated for the rejected half. Output: `input_ids`, `attention_mask`, the processor's image tensors (and
    per-token extras such as `mm_token_type_ids`) and `completion_mask`.

    Args:
        processor (`ProcessorMixin`):
            The model's processor.
        max_length (`int`, *optional*):
            Keep at most this many tokens from the start; a cut through an image's tokens raises an error.
        pad_to_multiple_of (`int`, *optional*):
            Pad the sequence length to a multiple of this value.
        return_tensors (`str`, *optional*, defaults to `"pt"`):
            Only `"pt"` is supported.
    """

    processor: Any
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __post_init__(self):
        self._encoder = _VisionEncoder(self.processor, self.max_length, self.pad_to_multiple_of)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        rendered = [_render(ex, self.processor, ("prompt", "chosen", "rejected"), None) for ex in examples]
        images = [example_images(example) for example in examples]
        prompts = [r["prompt"] for r in rendered]
        chosen = self._encoder.prompt_completion(prompts, [r["chosen"] for r in rendered], images)
        rejected = self._encoder.prompt_completion(prompts, [r["rejected"] for r in rendered], images)
        return _stack_rows(chosen, rejected, self._encoder.pad_token_id)


@dataclass
class DataCollatorForVisionUnpairedPreference:
    """Collator for vision-language KTO: `prompt + completion` rows, their labels and the mismatched KL rows.

    The KL rows pair each prompt with the completion of the previous row of the batch (cyclically) and share the
    prompt's images, so only their token tensors are returned (`KL_input_ids`, `KL_attention_mask`,
    `KL_completion_mask` and per-token extras).

    Args:
        processor (`ProcessorMixin`):
            The model's processor.
        max_length (`int`, *optional*):
            Keep at most this many tokens from the start; a cut through an image's tokens raises an error.
        calculate_kl (`bool`, *optional*, defaults to `True`):
            Build the KL rows.
        pad_to_multiple_of (`int`, *optional*):
            Pad the sequence length to a multiple of this value.
        return_tensors (`str`, *optional*, defaults to `"pt"`):
            Only `"pt"` is supported.
    """

    processor: Any
    max_length: int | None = None
    calculate_kl: bool = True
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __post_init__(self):
        self._encoder = _VisionEncoder(self.processor, self.max_length, self.pad_to_multiple_of)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        rendered = [_render(ex, self.processor, ("prompt", "completion"), None) for ex in examples]
        images = [example_images(example) for example in examples]
        prompts = [r["prompt"] for r in rendered]
        completions = [r["completion"] for r in rendered]
        batch = self._encoder.prompt_completion(prompts, completions, images)
        if self.calculate_kl:
            shifted = completions[-1:] + completions[:-1]
            kl = self._encoder.prompt_completion(prompts, shifted, images)
            for key in ("input_ids", "attention_mask", "completion_mask", *_TOKEN_LEVEL_KEYS):
                if key in kl:
                    batch[f"KL_{key}"] = kl[key]
        batch["label"] = torch.tensor([bool(example["label"]) for example in examples])
        return batch

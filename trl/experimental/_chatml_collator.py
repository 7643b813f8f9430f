"""Collation of chat conversations for the distillation trainers: the last assistant turn is the completion."""

import json
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ..trainer.utils import pad


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's pieces are byte-level (GPT-2 style: one character of a piece is one byte of text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    decoders = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(d.get("type") == "ByteLevel" for d in decoders)


def _piece_byte_len(tokenizer: PreTrainedTokenizerBase, token_id: int, byte_level: bool) -> int:
    """Number of bytes of text one token stands for (special tokens: their UTF-8 spelling)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return 0
    if token_id in tokenizer.all_special_ids or piece in tokenizer.get_added_vocab():
        return len(piece.encode("utf-8"))
    if byte_level:
        return len(piece)
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # SentencePiece byte fallback
        return 1
    return len(piece.replace("\u2581", " ").encode("utf-8"))


def _completion_byte_offsets(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], byte_level: bool | None = None
) -> list[tuple[int, int]]:
    """`(start, end)` byte offsets of each token within the text the tokens spell, by cumulative piece lengths."""
    if byte_level is None:
        byte_level = _is_byte_level(tokenizer)
    offsets, position = [], 0
    for token_id in token_ids:
        length = _piece_byte_len(tokenizer, token_id, byte_level)
        offsets.append((position, position + length))
        position += length
    return offsets


@dataclass
class DataCollatorForChatML:
    """Tokenize and left-pad conversations, marking the last assistant turn as the completion.

    Each example holds a conversation under `messages_key` (a list of `{"role", "content"}` messages ending with the
    assistant turn to learn), or a `prompt` / `completion` pair (conversational or plain text). The prompt is every
    message but the last, rendered with the chat template and its generation prompt; the completion is the rest of
    the rendered conversation.

    The batch holds `input_ids`, `attention_mask` and `labels` (-100 on the prompt and padding) of the whole
    sequence, the prompt alone as `prompts` / `prompt_attention_mask` (what generation starts from), and
    `byte_offsets` `(batch, length, 2)`: each completion token's byte span within the completion text (0 elsewhere),
    used to align tokenizations. Everything is left-padded. With `max_length`, the sequence keeps its last
    `max_length` tokens (the prompt is cut from the left); an example whose completion alone fills the window raises.

    Args:
        tokenizer: Tokenizer with a chat template (a missing pad token is set to the eos token).
        ignore_index: Label of positions without loss.
        max_length: Maximum number of tokens per sequence, or None.
        prompt_key: Column of the prompt in prompt-completion data.
        messages_key: Column of the conversation.
    """

    tokenizer: PreTrainedTokenizerBase
    ignore_index: int = -100
    max_length: int | None = None
    prompt_key: str = "prompt"
    messages_key: str = "messages"

    def __post_init__(self):
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token is None:
                raise ValueError("The tokenizer has neither a pad token nor an eos token; set tokenizer.pad_token.")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"`max_length` must be at least 2 (a prompt token and a completion token), got {self.max_length}."
            )
        self._byte_level = _is_byte_level(self.tokenizer)

    def _texts(self, example: dict[str, Any]) -> tuple[str, str]:
        """`(prompt_text, full_text)` of one example."""
        if self.messages_key in example and example[self.messages_key] is not None:
            messages = example[self.messages_key]
            if not isinstance(messages, list) or len(messages) < 2:
                raise ValueError(
                    f"`{self.messages_key}` must be a list of at least two messages (a prompt and the assistant turn "
                    f"to learn), got {messages!r}."
                )
            prompt_messages = messages[:-1]
        elif self.prompt_key in example and "completion" in example:
            prompt, completion = example[self.prompt_key], example["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):
                return prompt, prompt + completion
            prompt_messages, messages = prompt, list(prompt) + list(completion)
        else:
            raise ValueError(
                f"Each example needs a `{self.messages_key}` conversation or `{self.prompt_key}` and `completion`; "
                f"got the keys {sorted(example)}."
            )
        prompt_text = self.tokenizer.apply_chat_template(prompt_messages, tokenize=False, add_generation_prompt=True)
        full_text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt_text, full_text

    def _token_ids(self, example: dict[str, Any]) -> tuple[list[int], int]:
        """`(ids, prompt_length)`: the whole rendered conversation's token ids (untruncated) and how many of them are
        the prompt's."""
        return self._tokenize_texts(*self._texts(example))

    def _tokenize_texts(self, prompt_text: str, full_text: str) -> tuple[list[int], int]:
        ids = self.tokenizer(full_text, add_special_tokens=False)["input_ids"]
        return ids, len(self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"])

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids, labels, prompts, offsets = [], [], [], []
        for example in examples:
            ids, prompt_len = self._token_ids(example)
            if self.max_length is not None and len(ids) > self.max_length:
                cut = len(ids) - self.max_length
                ids, prompt_len = ids[cut:], prompt_len - cut
                if prompt_len <= 0:
                    raise ValueError(
                        f"An example has no prompt tokens left after truncation to max_length={self.max_length}: its "
                        "completion alone fills the window, leaving nothing to generate from. Increase `max_length` "
                        "or shorten the completion."
                    )
            completion = ids[prompt_len:]
            input_ids.append(torch.tensor(ids))
            labels.append(torch.tensor([self.ignore_index] * prompt_len + completion))
            prompts.append(torch.tensor(ids[:prompt_len]))
            spans = [(0, 0)] * prompt_len + _completion_byte_offsets(self.tokenizer, completion, self._byte_level)
            offsets.append(torch.tensor(spans, dtype=torch.long).reshape(-1, 2))

        pad_id = self.tokenizer.pad_token_id
        masks = [torch.ones_like(ids) for ids in input_ids]
        prompt_masks = [torch.ones_like(ids) for ids in prompts]
        return {
            "input_ids": pad(input_ids, padding_value=pad_id, padding_side="left"),
            "attention_mask": pad(masks, padding_value=0, padding_side="left"),
            "labels": pad(labels, padding_value=self.ignore_index, padding_side="left"),
            "prompts": pad(prompts, padding_value=pad_id, padding_side="left"),
            "prompt_attention_mask": pad(prompt_masks, padding_value=0, padding_side="left"),
            "byte_offsets": pad(offsets, padding_value=0, padding_side="left"),
        }

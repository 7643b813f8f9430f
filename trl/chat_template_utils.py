"""Helpers around chat templates: cloning a template onto another model, training variants with generation markers,
response parsing schemas and a few template property checks.

The bundled templates live in `trl/chat_templates/*.jinja` and are exposed here as module-level strings
(`qwen2_5_chat_template`, `qwen2_5_training_chat_template`, `llama3_chat_template`, `llama3_training_chat_template`).
"""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase


if TYPE_CHECKING:
    from transformers import PreTrainedModel, ProcessorMixin


_TEMPLATE_DIR = Path(__file__).parent / "chat_templates"


def _load_template(filename: str) -> str:
    return (_TEMPLATE_DIR / filename).read_text(encoding="utf-8")


qwen2_5_chat_template = _load_template("qwen2_5.jinja")
qwen2_5_training_chat_template = _load_template("qwen2_5_training.jinja")
llama3_chat_template = _load_template("llama3.jinja")
llama3_training_chat_template = _load_template("llama3_training.jinja")

# family -> (plain template, training template with generation markers)
_FAMILIES: dict[str, tuple[str, str]] = {
    "qwen2_5": (qwen2_5_chat_template, qwen2_5_training_chat_template),
    "llama3": (llama3_chat_template, llama3_training_chat_template),
}

# Response parsing specifications (transformers' declarative `response_template` format), one per family.
_QWEN2_5_RESPONSE_SCHEMA: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            # The leading whitespace belongs to the separator between content and calls, not to either of them.
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        # Whitespace after the end token is swallowed too: a stray trailing "\n" would otherwise open an empty
        # content region whose close overwrites the real content.
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)\s*", "content": "text"},
    },
}

_LLAMA3_RESPONSE_SCHEMA: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            # A call is a bare JSON object {"name": ..., "parameters": {...}}; its closing brace is the one followed
            # by the end of the turn, another call, or the end of the text.
            "open_pattern": r'\s*\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
            "close_pattern": r"\}(?=\s*(?:<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>|\{\"name\"|$))",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"\s*(?:<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>)\s*", "content": "text"},
    },
}

_RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {"qwen2_5": _QWEN2_5_RESPONSE_SCHEMA, "llama3": _LLAMA3_RESPONSE_SCHEMA}

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Sentinel values used to probe a template's tool-calling support; unlikely to appear in any template text.
_PROBE_TOOL_NAME = "trl_probe_tool_7431"
_PROBE_ARG_KEY = "trl_probe_arg"
_PROBE_ARG_VALUE = "trl_probe_value_2291"
_PROBE_TOOL_RESULT = "trl_probe_result_5813"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _PROBE_TOOL_NAME,
            "description": "Probe tool.",
            "parameters": {
                "type": "object",
                "properties": {_PROBE_ARG_KEY: {"type": "string", "description": "Probe argument."}},
                "required": [_PROBE_ARG_KEY],
            },
        },
    }
]
_PROBE_CONVERSATION = [
    {"role": "user", "content": "Please call the tool."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": _PROBE_TOOL_NAME, "arguments": {_PROBE_ARG_KEY: _PROBE_ARG_VALUE}},
            }
        ],
    },
]
_PROBE_TOOL_MESSAGE = {"role": "tool", "name": _PROBE_TOOL_NAME, "content": _PROBE_TOOL_RESULT}


def _get_tokenizer(processing_class: PreTrainedTokenizerBase | ProcessorMixin) -> PreTrainedTokenizerBase:
    # Processors wrap a tokenizer; the tokenizer owns the vocabulary and the special tokens.
    return getattr(processing_class, "tokenizer", None) or processing_class


def _get_template(processing_class: PreTrainedTokenizerBase | ProcessorMixin) -> str | None:
    template = getattr(processing_class, "chat_template", None)
    if template is None and hasattr(processing_class, "tokenizer"):
        template = getattr(processing_class.tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template


def _require_template(processing_class: PreTrainedTokenizerBase | ProcessorMixin, purpose: str) -> str:
    template = _get_template(processing_class)
    if not template:
        raise ValueError(
            f"{purpose} needs a chat template, but the given {type(processing_class).__name__} has none. Set one "
            "first, e.g. `tokenizer.chat_template = trl.chat_template_utils.qwen2_5_chat_template`, or copy one from "
            "another model with `clone_chat_template`."
        )
    return template


def _normalize(template: str) -> str:
    return template.strip()


def _identify_family(template: str) -> str | None:
    """Name of the bundled family whose plain or training template equals `template`, else None."""
    normalized = _normalize(template)
    for family, (plain, training) in _FAMILIES.items():
        if normalized in (_normalize(plain), _normalize(training)):
            return family
    return None


def _input_ids(rendered: Any) -> list[int]:
    # `apply_chat_template(tokenize=True)` returns either a list of ids or a BatchEncoding, depending on versions.
    if isinstance(rendered, dict) or hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    return list(rendered)


def clone_chat_template(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    source_tokenizer_path: str,
    resize_to_multiple_of: int | None = 64,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, list[int]]:
    """Copy the chat template (and what it needs) from another tokenizer onto a model and its tokenizer.

    The source tokenizer's chat template is copied, its added tokens that the target vocabulary lacks are added, its
    end-of-sequence token becomes the target's (also written to the model config and generation config), and the
    model's embeddings are resized to the new vocabulary size, rounded up to a multiple of `resize_to_multiple_of`.
    Embedding rows beyond the vocabulary are given placeholder tokens `<extra_id_N>` so that tokenizer and model sizes
    match.

    Args:
        model ([`~transformers.PreTrainedModel`]):
            Model whose embeddings are resized.
        tokenizer ([`~transformers.PreTrainedTokenizerBase`]):
            Tokenizer that receives the chat template and the new tokens (modified in place).
        source_tokenizer_path (`str`):
            Path (or hub id) of the tokenizer to copy the chat template from.
        resize_to_multiple_of (`int` or `None`, *optional*, defaults to `64`):
            Round the new embedding size up to a multiple of this value. `None` resizes to the exact vocabulary size.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase, list[int]]`: The model, the tokenizer, and the ids of every
        token added to the tokenizer (copied tokens and placeholders), in increasing order.
    """
    source = AutoTokenizer.from_pretrained(source_tokenizer_path)
    source_template = source.chat_template
    if not source_template:
        raise ValueError(
            f"The tokenizer at {source_tokenizer_path!r} has no chat template to clone. Pass the path of a tokenizer "
            "that defines `chat_template`."
        )
    tokenizer.chat_template = source_template

    vocab = tokenizer.get_vocab()
    missing = [token for _, token in sorted(source.added_tokens_decoder.items()) if token.content not in vocab]
    if missing:
        tokenizer.add_tokens(missing)

    tokenizer.eos_token = source.eos_token
    eos_token_id = tokenizer.convert_tokens_to_ids(source.eos_token)
    model.config.eos_token_id = eos_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = eos_token_id

    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=resize_to_multiple_of)
    embedding_rows = model.get_input_embeddings().weight.shape[0]
    placeholders = []
    if embedding_rows > len(tokenizer):
        # Name the padding rows so that every embedding row has a token and `len(tokenizer)` equals the model vocab.
        vocab = tokenizer.get_vocab()
        index = 0
        while len(placeholders) < embedding_rows - len(tokenizer):
            if f"<extra_id_{index}>" not in vocab:  # a previous clone may already have used some names
                placeholders.append(f"<extra_id_{index}>")
            index += 1
        tokenizer.add_tokens(placeholders)

    if len(tokenizer) != model.get_input_embeddings().weight.shape[0]:
        raise RuntimeError(
            f"After cloning the chat template the tokenizer has {len(tokenizer)} tokens but the model has "
            f"{model.get_input_embeddings().weight.shape[0]} embedding rows; they should match."
        )
    vocab = tokenizer.get_vocab()
    added_ids = sorted(vocab[content] for content in [token.content for token in missing] + placeholders)
    return model, tokenizer, added_ids


def has_generation_markers(chat_template: str | dict[str, str]) -> bool:
    """Whether a chat template marks assistant output with a `{% generation %}` block.

    Args:
        chat_template (`str` or `dict[str, str]`):
            Template source, or a mapping of named templates (its `"default"` entry is checked).

    Returns:
        `bool`: True when the template contains a `{% generation %}` tag.
    """
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default") or ""
    return bool(_GENERATION_TAG.search(chat_template or ""))


def get_training_chat_template(
    processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> str | None:
    """Return the training variant (with `{% generation %}` markers) of a tokenizer's chat template.

    Training variants let `apply_chat_template(..., return_assistant_tokens_mask=True)` report which tokens the
    assistant produced, which assistant-only losses need.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`], *optional*, defaults to `None`):
            Tokenizer or processor whose chat template is inspected.
        tokenizer ([`~transformers.PreTrainedTokenizerBase`], *optional*, defaults to `None`):
            Deprecated alias of `processing_class`.

    Returns:
        `str` or `None`: `None` when the current template already has generation markers (and, if it supports tool
        calling, is prefix-preserving); otherwise the bundled training template of the recognised family.

    Raises:
        ValueError: If the template is missing or belongs to no bundled family.
    """
    if tokenizer is not None:
        if processing_class is not None:
            raise TypeError("Pass either `processing_class` or the deprecated `tokenizer`, not both.")
        warnings.warn(
            "`tokenizer` is deprecated in `get_training_chat_template`; pass `processing_class` instead.",
            FutureWarning,
            stacklevel=2,
        )
        processing_class = tokenizer
    if processing_class is None:
        raise TypeError("get_training_chat_template() missing required argument: 'processing_class'.")

    template = _require_template(processing_class, "get_training_chat_template")
    if has_generation_markers(template):
        if not supports_tool_calling(processing_class) or is_chat_template_prefix_preserving(processing_class):
            return None
    family = _identify_family(template)
    if family is None:
        supported = ", ".join(sorted(_FAMILIES))
        raise ValueError(
            "The chat template of the given processing class is not one TRL has a training variant for (supported "
            f"families: {supported}), and it has no usable `{{% generation %}}` markers. Write a training version of "
            "the template that wraps each assistant turn in `{% generation %}...{% endgeneration %}` and pass it "
            "through `chat_template_path` (e.g. `SFTConfig(chat_template_path='path/to/template.jinja')`), or turn "
            "off `assistant_only_loss`."
        )
    plain, training = _FAMILIES[family]
    if _normalize(template) == _normalize(training):
        # Already the bundled training template (which is prefix-preserving); nothing to swap in.
        return None
    return training


def add_response_schema(
    processing_class: PreTrainedTokenizerBase | ProcessorMixin,
) -> PreTrainedTokenizerBase | ProcessorMixin:
    """Attach a response parser specification matching the processing class's chat template.

    With the specification in place, `tokenizer.parse_response(...)` turns generated text back into a message dict
    (content and tool calls).

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            Tokenizer or processor using one of the bundled chat template families.

    Returns:
        The same object, with `response_template` (transformers >= 5.13) or `response_schema` set.

    Raises:
        ValueError: If the chat template is missing or not recognised.
    """
    template = _require_template(processing_class, "add_response_schema")
    family = _identify_family(template)
    if family is None:
        raise ValueError(
            "No response schema is known for this chat template. Supported families: "
            f"{', '.join(sorted(_RESPONSE_SCHEMAS))}. Set `tokenizer.response_template` yourself for other templates."
        )
    schema = _RESPONSE_SCHEMAS[family]
    attribute = "response_template" if _tokenizer_uses_response_template() else "response_schema"
    targets = [processing_class]
    inner = getattr(processing_class, "tokenizer", None)
    if inner is not None and inner is not processing_class:
        targets.append(inner)
    for target in targets:
        setattr(target, attribute, dict(schema))
    return processing_class


def _tokenizer_uses_response_template() -> bool:
    # transformers 5.13 renamed the parser attribute; the signature of `parse_response` tells the versions apart.
    parse = getattr(PreTrainedTokenizerBase, "parse_response", None)
    if parse is None:
        return False
    return "prefix" in inspect.signature(parse).parameters


def supports_tool_calling(processing_class: PreTrainedTokenizerBase | ProcessorMixin) -> bool:
    """Whether the chat template renders tool definitions, tool calls and tool results.

    A synthetic user / assistant-with-tool-call / tool-result conversation is rendered; the template passes when the
    tool name, the argument key and value, and the tool result all appear in the output.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            Tokenizer or processor to check.

    Returns:
        `bool`: False when there is no chat template or rendering fails.
    """
    if not _get_template(processing_class):
        return False
    try:
        text = processing_class.apply_chat_template(
            [*_PROBE_CONVERSATION, _PROBE_TOOL_MESSAGE], tools=_PROBE_TOOLS, tokenize=False
        )
    except Exception:
        return False
    if not isinstance(text, str):
        return False
    return all(marker in text for marker in (_PROBE_TOOL_NAME, _PROBE_ARG_KEY, _PROBE_ARG_VALUE, _PROBE_TOOL_RESULT))


def is_chat_template_prefix_preserving(processing_class: PreTrainedTokenizerBase | ProcessorMixin) -> bool:
    """Whether appending a tool result to a conversation keeps the earlier tokens unchanged.

    Multi-turn tool use extends a conversation turn by turn; that only works when the tokens of
    `[user, assistant-with-tool-call]` are a prefix of the tokens of the same conversation plus the tool result,
    rendered with the generation prompt.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            Tokenizer or processor to check.

    Returns:
        `bool`: True when the shorter rendering is a token prefix of the longer one.
    """
    _require_template(processing_class, "is_chat_template_prefix_preserving")
    prefix_ids = _input_ids(
        processing_class.apply_chat_template(_PROBE_CONVERSATION, tools=_PROBE_TOOLS, tokenize=True)
    )
    full_ids = _input_ids(
        processing_class.apply_chat_template(
            [*_PROBE_CONVERSATION, _PROBE_TOOL_MESSAGE], tools=_PROBE_TOOLS, tokenize=True, add_generation_prompt=True
        )
    )
    return full_ids[: len(prefix_ids)] == prefix_ids


def is_chat_template_stop_token_trained(
    processing_class: PreTrainedTokenizerBase | ProcessorMixin, chat_template: str | None = None
) -> bool:
    """Whether the assistant mask of a template covers the end-of-turn token.

    With `assistant_only_loss`, only tokens inside the `{% generation %}` blocks are trained; if the end-of-turn
    token is outside them, the model never learns to stop.

    Args:
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            Tokenizer or processor used to render and tokenize.
        chat_template (`str` or `None`, *optional*, defaults to `None`):
            Template to check instead of the processing class's own.

    Returns:
        `bool`: True when the last non-whitespace token inside the assistant mask is an added or special token.
    """
    template = chat_template if chat_template is not None else _require_template(processing_class, "This check")
    if not has_generation_markers(template):
        return False
    conversation = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi, how are you?"}]
    encoded = processing_class.apply_chat_template(
        conversation,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids = list(encoded["input_ids"])
    mask = list(encoded["assistant_masks"])
    tokenizer = _get_tokenizer(processing_class)
    masked = [token_id for token_id, flag in zip(ids, mask) if flag]
    while masked and not tokenizer.decode([masked[-1]]).strip():
        masked.pop()
    if not masked:
        return False
    special_ids = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return masked[-1] in special_ids


def parse_response(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    prefix: list[int] | None = None,
    tools: list | None = None,
) -> dict:
    """Parse generated token ids into an assistant message, falling back to plain decoded text.

    Args:
        tokenizer ([`~transformers.PreTrainedTokenizerBase`]):
            Tokenizer with a response parser (see [`add_response_schema`]).
        ids (`list[int]`):
            Generated token ids (completion only).
        prefix (`list[int]` or `None`, *optional*, defaults to `None`):
            Prompt token ids that preceded the generation; some templates pre-write part of the answer there.
        tools (`list` or `None`, *optional*, defaults to `None`):
            Tool schemas or callables, used to cast tool-call arguments to their declared types.

    Returns:
        `dict`: A message with `role`, a string `content` (trailing end-of-sequence token removed) and, when present,
        well-formed `tool_calls` (each with a string function name and dict arguments). When parsing fails, the
        message is `{"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}`.

    Raises:
        AttributeError: If the tokenizer has no response parser at all (see [`add_response_schema`]).
    """
    if not any(getattr(tokenizer, name, None) for name in ("response_template", "response_schema")):
        # As in TRL: without a parser specification there is nothing to parse with (AttributeError).
        raise AttributeError(
            f"{type(tokenizer).__name__} has no response parser (`response_template` / `response_schema`), so "
            "generated text cannot be parsed into a message. Call `trl.chat_template_utils.add_response_schema("
            "tokenizer)` first, or set `tokenizer.response_template` yourself."
        )
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if prefix is not None and hasattr(prefix, "tolist"):
        prefix = prefix.tolist()
    fallback = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    try:
        parameters = inspect.signature(tokenizer.parse_response).parameters
        kwargs: dict[str, Any] = {}
        if "prefix" in parameters:
            # Newer transformers require a prefix; an empty list explicitly opts out of prefix-aware parsing.
            kwargs["prefix"] = list(prefix) if prefix is not None else []
        if "tools" in parameters and tools is not None:
            kwargs["tools"] = tools
        message = tokenizer.parse_response(ids, **kwargs)
        if not isinstance(message, dict):
            return fallback
        message = dict(message)
        message.setdefault("role", "assistant")
        content = message.get("content")
        content = "" if content is None else content if isinstance(content, str) else str(content)
        eos = tokenizer.eos_token
        if eos and content.endswith(eos):
            content = content[: -len(eos)]
        message["content"] = content
        if "tool_calls" in message:
            message["tool_calls"] = _validate_tool_calls(message["tool_calls"])
        return message
    except Exception:
        return fallback


def _validate_tool_calls(tool_calls: Any) -> list[dict]:
    if not isinstance(tool_calls, list):
        raise ValueError(f"tool_calls should be a list, got {type(tool_calls).__name__}.")
    validated = []
    for call in tool_calls:
        if not isinstance(call, dict):
            raise ValueError(f"Each tool call should be a dict, got {type(call).__name__}.")
        if "function" not in call:  # flat {"name", "arguments"} form
            call = {"type": "function", "function": call}
        function = call["function"]
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("Each tool call needs a function with a string name.")
        arguments = function.get("arguments")
        function = {**function, "arguments": {} if arguments is None else arguments}
        validated.append({**call, "type": call.get("type", "function"), "function": function})
    return validated

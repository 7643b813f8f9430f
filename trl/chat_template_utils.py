"""Helpers around chat templates: cloning a template onto another model, training variants with generation markers,
response parsing schemas and a few template property checks.

The bundled templates live in `trl/chat_templates/*.jinja` and are exposed here as module-level strings
(`qwen2_5_chat_template`, `qwen2_5_training_chat_template`, `llama3_chat_template`, `llama3_training_chat_template`).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import warnings
from typing import TYPE_CHECKING, Any

import transformers
from transformers import AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from ._chat.families import ALL_FAMILIES as _FAMILY_LIST
from ._chat.families import FAMILIES as _MODEL_FAMILIES
from ._chat.families import Family, load_template
from ._chat.recognition import identify_family
from ._compat import response_content_parsers


if TYPE_CHECKING:
    from transformers import PreTrainedModel, ProcessorMixin


def _without_markers(template: str) -> str:
    # The generation tags become comments with the same whitespace control, so the text rendered is unchanged.
    return _MARKER_TAG.sub(lambda m: "{#" + m.group(1) + m.group(2) + m.group(3) + "#}", template)


_MARKER_TAG = re.compile(r"\{%(-?)\s*((?:end)?generation)\s*(-?)%\}")

# Module-level template strings: `<family>_training_chat_template` (with generation markers) and
# `<family>_chat_template` (the same template without them) for every family with a training variant, plus the
# templates of the offline test tokenizers (`tiny_qwen2_5_chat_template`, `tiny_llama3_chat_template`).
for _family in _FAMILY_LIST:
    if _family.has_training:
        globals()[f"{_family.name}_training_chat_template"] = _family.training_template
        if not _family.name.startswith("tiny_"):
            globals()[f"{_family.name}_chat_template"] = _without_markers(_family.training_template)
tiny_qwen2_5_chat_template = load_template("tiny_qwen2_5.jinja")
tiny_llama3_chat_template = load_template("tiny_llama3.jinja")
tiny_qwen2_5_training_chat_template = load_template("tiny_qwen2_5_training.jinja")
tiny_llama3_training_chat_template = load_template("tiny_llama3_training.jinja")

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
_PROBE_CONVERSATION_JSON_ARGUMENTS = [
    _PROBE_CONVERSATION[0],
    {
        **_PROBE_CONVERSATION[1],
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": _PROBE_TOOL_NAME, "arguments": json.dumps({_PROBE_ARG_KEY: _PROBE_ARG_VALUE})},
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


def _special_tokens(processing_class: PreTrainedTokenizerBase | ProcessorMixin) -> dict[str, str]:
    # The template variables `apply_chat_template` provides (bos_token, eos_token, ...), as strings.
    tokenizer = _get_tokenizer(processing_class)
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {key: str(value) for key, value in tokens.items() if isinstance(value, str)}


def _identify_family(processing_class: PreTrainedTokenizerBase | ProcessorMixin, template: str) -> Family | None:
    """The known family whose templates render like `template` (see `trl._chat.recognition`), else None."""
    return identify_family(template, _special_tokens(processing_class))


def _supported_families() -> str:
    return ", ".join(family.title for family in _MODEL_FAMILIES if family.has_training)


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
    family = _identify_family(processing_class, template)
    if family is None or not family.has_training:
        found = f"a {family.title} template, for which TRL has no training variant" if family else "not recognised"
        raise ValueError(
            "The chat template is not training-compatible (it lacks `{% generation %}` markers, or it supports tool "
            f"calling without being prefix-preserving) and TRL cannot patch it: it is {found}. TRL has training "
            f"variants for: {_supported_families()}. Write a training version of the template that wraps each "
            "assistant turn in `{% generation %}...{% endgeneration %}` and pass it through `chat_template_path` (e.g. "
            "`SFTConfig(chat_template_path='path/to/template.jinja')`), or turn off `assistant_only_loss`."
        )
    training = family.training_template
    if template.strip() == training.strip():
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
    family = _identify_family(processing_class, template)
    if family is None or family.schema is None:
        found = f"there is none for {family.title} templates" if family else "the template is not recognised"
        supported = ", ".join(f.title for f in _MODEL_FAMILIES if f.schema is not None)
        raise ValueError(
            f"Unrecognized chat template, failed to add response schema: {found}. TRL has response schemas for: "
            f"{supported}. Set `tokenizer.response_template` yourself for other templates (see transformers' "
            "response parsing documentation)."
        )
    schema = family.schema
    _warn_on_unparsable_fields(family.title, schema)
    attribute = "response_template" if _tokenizer_uses_response_template() else "response_schema"
    targets = [processing_class]
    inner = getattr(processing_class, "tokenizer", None)
    if inner is not None and inner is not processing_class:
        targets.append(inner)
    for target in targets:
        setattr(target, attribute, dict(schema))
    return processing_class


def _warn_on_unparsable_fields(title: str, schema: dict) -> None:
    """Warn when the installed transformers cannot parse some fields of `schema` (they would come back as text)."""
    known = response_content_parsers()
    fields = schema.get("fields", {})
    missing = {name: spec["content"] for name, spec in fields.items() if spec.get("content", "text") not in known}
    if missing:
        found = ", ".join(f"{name} ({content!r})" for name, content in missing.items())
        what = (
            "has no response parser (`tokenizer.parse_response`, transformers 5) for" if not known else "cannot parse"
        )
        warnings.warn(
            f"transformers {transformers.__version__} {what} these fields of {title} responses: {found}. "
            "Generated text will not be split into them (e.g. tool calls stay in the content and are never run). "
            "Upgrade transformers (`pip install -U transformers`) to parse them.",
            UserWarning,
            stacklevel=3,
        )


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
    # Arguments as a dict first; some templates (DeepSeek-V3 style) only accept them as a JSON string.
    return any(
        _renders_tool_round_trip(processing_class, conversation)
        for conversation in (_PROBE_CONVERSATION, _PROBE_CONVERSATION_JSON_ARGUMENTS)
    )


def _renders_tool_round_trip(processing_class: Any, conversation: list[dict[str, Any]]) -> bool:
    try:
        text = processing_class.apply_chat_template(
            [*conversation, _PROBE_TOOL_MESSAGE], tools=_PROBE_TOOLS, tokenize=False
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
    try:
        return _is_prefix_preserving_with(processing_class, _PROBE_CONVERSATION)
    except Exception:
        # Templates that need tool-call arguments as a JSON string (DeepSeek-V3 style) fail on a dict; a template
        # failing on both raises the second error.
        return _is_prefix_preserving_with(processing_class, _PROBE_CONVERSATION_JSON_ARGUMENTS)


def _is_prefix_preserving_with(processing_class: Any, conversation: list[dict[str, Any]]) -> bool:
    prefix_ids = _input_ids(processing_class.apply_chat_template(conversation, tools=_PROBE_TOOLS, tokenize=True))
    full_ids = _input_ids(
        processing_class.apply_chat_template(
            [*conversation, _PROBE_TOOL_MESSAGE], tools=_PROBE_TOOLS, tokenize=True, add_generation_prompt=True
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
        `bool`: True when the first non-whitespace token after the answer inside the assistant mask is an added or
        special token; False when the template cannot render a plain conversation.
    """
    template = chat_template if chat_template is not None else _require_template(processing_class, "This check")
    if not has_generation_markers(template):
        return False
    conversation = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi, how are you?"}]
    try:
        encoded = processing_class.apply_chat_template(
            conversation,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
    except Exception:  # a template that cannot render plain string contents (typed parts only) trains no stop token
        return False
    ids = list(encoded["input_ids"])
    mask = list(encoded["assistant_masks"])
    tokenizer = _get_tokenizer(processing_class)
    # The first run of masked tokens is the assistant turn; a later run (e.g. a closing end-of-sequence token in a
    # block of its own) is not the end-of-turn token that follows an answer.
    start = mask.index(1) if 1 in mask else len(mask)
    end = mask.index(0, start) if 0 in mask[start:] else len(mask)
    masked = ids[start:end]
    # The stop token is the first non-whitespace token after the answer text.
    answer = conversation[-1]["content"]
    position = 0
    while position < len(masked) and answer not in tokenizer.decode(masked[: position + 1]):
        position += 1
    following = [token for token in masked[position + 1 :] if tokenizer.decode([token]).strip()]
    if not following:
        return False
    special_ids = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return following[0] in special_ids


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
        if "prefix" in parameters and prefix is not None:
            # Without a prefix, newer transformers refuse to parse (the answer may start in the prompt) and the
            # plain decoded text is returned, as in TRL.
            kwargs["prefix"] = list(prefix)
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


def apply_chat_template_path(model: Any, processing_class: Any, path: str) -> tuple[Any, Any, list[int]]:
    """Set the chat template named by a trainer's `chat_template_path` option.

    A `.jinja`/`.j2` file is read and used as the template as is. Anything else is taken as a tokenizer directory
    or id whose template is cloned with `clone_chat_template`, which may add tokens to the tokenizer and resize
    the model's embeddings.

    Args:
        model: The model (its embeddings may be resized).
        processing_class: Tokenizer or processor receiving the template.
        path: A template file or a tokenizer directory / id.

    Returns:
        `(model, processing_class, added_token_ids)`; `added_token_ids` is empty for a template file.
    """
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if os.path.isfile(path) and path.endswith((".jinja", ".j2")):
        with open(path) as f:
            tokenizer.chat_template = f.read()
        if tokenizer is not processing_class:
            processing_class.chat_template = tokenizer.chat_template
        return model, processing_class, []
    if os.path.isfile(path):
        raise ValueError(
            f"chat_template_path={path!r} is a file but not a .jinja/.j2 template. Give a template file or a "
            "tokenizer directory whose chat template should be copied."
        )

    model, tokenizer, added_tokens = clone_chat_template(model, tokenizer, path)
    return model, tokenizer, added_tokens

"""Rendering conversational examples to text with the chat template of a tokenizer or processor.

Implementation module of `trl.data_utils` (import the public names from there).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .conversational import ALLOWED_ROLES, is_conversational


_CHAT_TEMPLATE_KEY_SETS = (
    {"messages"},  # language modeling
    {"prompt"},  # prompt-only
    {"prompt", "completion"},  # prompt-completion
    {"prompt", "chosen", "rejected"},  # preference with explicit prompt
    {"chosen", "rejected"},  # preference with implicit prompt
    {"prompt", "completion", "label"},  # unpaired preference
)
_CHAT_TEMPLATE_KEYS = ("prompt", "chosen", "rejected", "completion", "messages", "label")


def _check_roles(messages: list[dict[str, Any]], field: str) -> None:
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ALLOWED_ROLES:
            raise ValueError(
                f"Message {index} of the '{field}' field has role {role!r}, but the role of every message must be one "
                f"of {list(ALLOWED_ROLES)}. Rename the role of that message (e.g. with `dataset.map`) to one of "
                "the allowed roles."
            )


def _check_has_chat_template(processing_class: Any) -> None:
    if getattr(processing_class, "chat_template", None):
        return
    name = getattr(processing_class, "name_or_path", None) or "<unnamed>"
    raise ValueError(
        f"The processing class {type(processing_class).__name__} ({name!r}) has no chat template, but a "
        "conversational example can only be rendered with one. Set a chat template first: pass `chat_template_path` "
        "in the trainer config, call `trl.clone_chat_template(model, tokenizer, source_tokenizer_path)`, or assign a "
        "Jinja template string to `tokenizer.chat_template`."
    )


def _resolve_tools(example: dict[str, Any], tools: list | None) -> list | None:
    # A per-example `tools` column takes precedence over the function argument; datasets often store it as JSON.
    example_tools = example.get("tools")
    if example_tools is None:
        return tools
    if isinstance(example_tools, str):
        try:
            example_tools = json.loads(example_tools)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"The 'tools' field is a string but not valid JSON ({error}). Store a list of JSON schemas, or a JSON "
                "string encoding such a list."
            ) from error
    if not isinstance(example_tools, list):
        raise ValueError(
            f"The 'tools' field must be a list of tool schemas/callables or a JSON string encoding a list, found "
            f"{type(example_tools).__name__}."
        )
    return example_tools


def _longest_common_prefix(text: str, other: str) -> str:
    limit = min(len(text), len(other))
    index = 0
    while index < limit and text[index] == other[index]:
        index += 1
    return text[:index]


def apply_chat_template(
    example: dict[str, list[dict[str, str]]],
    processing_class: Any,
    tools: list[dict | Callable] | None = None,
    **template_kwargs: Any,
) -> dict[str, str]:
    """Render a conversational example to text with the chat template of `processing_class`.

    The example must contain exactly one of these sets of keys (other keys, such as `"images"`, `"tools"` or
    `"chat_template_kwargs"`, are ignored for this check): `{"messages"}`, `{"prompt"}`, `{"prompt", "completion"}`,
    `{"prompt", "chosen", "rejected"}`, `{"chosen", "rejected"}` or `{"prompt", "completion", "label"}`.

    - `"messages"` is rendered as a whole and returned under `"text"`.
    - `"prompt"` is rendered with the generation prompt when its last message comes from the user or a tool, or as a
      continuation of the final message when its last message comes from the assistant.
    - `"completion"`, `"chosen"` and `"rejected"` are rendered together with the prompt; the prompt text is then cut
      back to the longest common prefix of both renderings and the answer is the remainder, so that the answer starts
      exactly where the rendered prompt ends.
    - Without a prompt, `"chosen"` and `"rejected"` are rendered on their own.
    - `"label"` is copied through unchanged.

    Args:
        example (`dict[str, list[dict[str, str]]]`):
            A conversational example. An optional `"tools"` field (a list, or a JSON string encoding a list) overrides
            the `tools` argument, and an optional `"chat_template_kwargs"` dict is merged into the template call.
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            Tokenizer or processor whose `apply_chat_template` is used. It must define a chat template.
        tools (`list[dict | Callable]`, *optional*):
            Tools (JSON schemas or Python functions) made available to the model through the template.
        **template_kwargs:
            Extra keyword arguments forwarded to `apply_chat_template` (template variables such as
            `enable_thinking`).

    Returns:
        `dict[str, str]`: The rendered example, with keys among `"text"`, `"prompt"`, `"completion"`, `"chosen"`,
        `"rejected"` and `"label"`.

    Raises:
        KeyError: If the example keys do not form one of the supported sets.
        ValueError: If a message has an unknown role, the prompt ends with an unsupported role, or the processing
            class has no chat template.

    Example:
    ```python
    >>> from transformers import AutoTokenizer
    >>> from trl.assets import get_tokenizer_path
    >>> tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_path("qwen2_5"))
    >>> example = {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}
    >>> apply_chat_template(example, tokenizer)["completion"]
    '4<|im_end|>\\n'
    ```
    """
    keys = {key for key in example if key in _CHAT_TEMPLATE_KEYS}
    if keys not in _CHAT_TEMPLATE_KEY_SETS:
        expected = " or ".join(str(sorted(key_set)) for key_set in _CHAT_TEMPLATE_KEY_SETS)
        raise KeyError(
            f"Invalid keys in the example: {keys}. Expected one of these key sets: {expected}. Rename your "
            "columns (e.g. `dataset.rename_column(old, new)`) or remove the extra ones."
        )
    _check_has_chat_template(processing_class)
    for key in ("prompt", "completion", "chosen", "rejected", "messages"):
        if key in example:
            if not isinstance(example[key], list):
                raise ValueError(
                    f"The '{key}' field must be a list of messages (conversational format) to apply a chat template, "
                    f"found {type(example[key]).__name__}. Use `maybe_apply_chat_template` for datasets that may be "
                    "in standard format."
                )
            _check_roles(example[key], key)

    tools = _resolve_tools(example, tools)
    kwargs = {key: value for key, value in (example.get("chat_template_kwargs") or {}).items() if value is not None}
    kwargs.update(template_kwargs)
    kwargs["tokenize"] = False
    kwargs.pop("add_generation_prompt", None)
    kwargs.pop("continue_final_message", None)

    def render(messages: list[dict[str, Any]], **extra: Any) -> str:
        return processing_class.apply_chat_template(messages, tools=tools, **kwargs, **extra)

    output: dict[str, Any] = {}
    if "messages" in example:
        output["text"] = render(example["messages"])

    if "prompt" in example:
        prompt_messages = example["prompt"]
        if len(prompt_messages) == 0:
            raise ValueError("The 'prompt' field is an empty list of messages; it needs at least one message.")
        last_role = prompt_messages[-1]["role"]
        if last_role in ("user", "tool"):
            prompt = render(prompt_messages, add_generation_prompt=True)
        elif last_role == "assistant":
            prompt = render(prompt_messages, continue_final_message=True)
        else:
            raise ValueError(
                f"The last message of the prompt has role {last_role!r}, but it must be one of ['user', 'tool'] (the "
                "generation prompt is added) or 'assistant' (the message is continued)."
            )
        # Rendering prompt + answer can differ from the bare prompt right at the junction (e.g. templates that
        # insert a thinking block after the generation prompt). Cutting the prompt back to the longest common prefix
        # guarantees that every answer starts exactly where the prompt ends.
        answers = {}
        for key in ("completion", "chosen", "rejected"):
            if key in example:
                full = render(prompt_messages + example[key])
                prompt = _longest_common_prefix(prompt, full)
                answers[key] = full
        output["prompt"] = prompt
        for key, full in answers.items():
            output[key] = full[len(prompt) :]
    else:
        for key in ("chosen", "rejected"):
            if key in example:
                output[key] = render(example[key])

    if "label" in example:
        output["label"] = example["label"]
    return output


def maybe_apply_chat_template(
    example: dict[str, list[dict[str, str]]],
    processing_class: Any,
    tools: list[dict | Callable] | None = None,
    **template_kwargs: Any,
) -> dict[str, str]:
    """Apply [`apply_chat_template`] to conversational examples and return standard ones unchanged.

    Args:
        example (`dict[str, list[dict[str, str]]]`):
            A single dataset row, standard or conversational.
        processing_class ([`~transformers.PreTrainedTokenizerBase`] or [`~transformers.ProcessorMixin`]):
            Tokenizer or processor used to render conversational examples.
        tools (`list[dict | Callable]`, *optional*):
            Tools made available to the model through the template.
        **template_kwargs:
            Extra keyword arguments forwarded to `apply_chat_template`.

    Returns:
        `dict[str, str]`: The rendered example (conversational input) or the input example (standard input).

    Example:
    ```python
    >>> maybe_apply_chat_template({"prompt": "The sky is", "completion": " blue."}, tokenizer)
    {'prompt': 'The sky is', 'completion': ' blue.'}
    ```
    """
    if is_conversational(example):
        return apply_chat_template(example, processing_class, tools=tools, **template_kwargs)
    return example

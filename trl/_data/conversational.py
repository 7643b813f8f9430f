"""Conversational examples (lists of `{"role": ..., "content": ...}` messages): detection, ShareGPT-to-ChatML
conversion, and the typed-content messages of vision-language processors.

Implementation module of `trl.data_utils` (import the public names from there).
"""

from __future__ import annotations

from typing import Any


# Keys whose values may hold a list of messages.
_CONVERSATIONAL_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")
# Roles accepted in conversational examples ("developer" is the system role of some recent templates).
ALLOWED_ROLES = ("system", "developer", "user", "assistant", "tool")


def _is_message_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and isinstance(value[0], dict) and "role" in value[0]


def is_conversational(example: dict[str, Any]) -> bool:
    """Tell whether an example is in conversational format.

    The first of the keys `"prompt"`, `"chosen"`, `"rejected"`, `"completion"` and `"messages"` present in the
    example is inspected: the example is conversational when that value is a list whose first element is a dict with
    a `"role"` key.

    Args:
        example (`dict[str, Any]`):
            A single dataset row.

    Returns:
        `bool`: `True` if the example is conversational, `False` otherwise.

    Example:
    ```python
    >>> is_conversational({"prompt": [{"role": "user", "content": "What color is the sky?"}]})
    True
    >>> is_conversational({"prompt": "The sky is"})
    False
    ```
    """
    for key in _CONVERSATIONAL_KEYS:
        if key in example:
            return _is_message_list(example[key])
    return False


def is_conversational_from_value(example: dict[str, Any]) -> bool:
    """Tell whether an example is a ShareGPT-style conversation (`"from"` / `"value"` message keys).

    Such examples store their conversation under the `"conversations"` key, e.g.
    `{"conversations": [{"from": "user", "value": "Hi"}]}`. Use [`maybe_convert_to_chatml`] to convert them to the
    `"role"` / `"content"` (ChatML) convention.

    Args:
        example (`dict[str, Any]`):
            A single dataset row.

    Returns:
        `bool`: `True` if `example["conversations"]` is a list whose first message has both `"from"` and `"value"`.

    Example:
    ```python
    >>> is_conversational_from_value({"conversations": [{"from": "user", "value": "Hi"}]})
    True
    >>> is_conversational_from_value({"messages": [{"role": "user", "content": "Hi"}]})
    False
    ```
    """
    conversation = example.get("conversations")
    if isinstance(conversation, list) and len(conversation) > 0:
        first = conversation[0]
        return isinstance(first, dict) and "from" in first and "value" in first
    return False


def maybe_convert_to_chatml(example: dict[str, list]) -> dict[str, list]:
    """Convert a ShareGPT-style (`"from"` / `"value"`) example to ChatML (`"role"` / `"content"`).

    In each message of the `"prompt"`, `"completion"`, `"chosen"`, `"rejected"`, `"messages"` and `"conversations"`
    fields, `"from"` is renamed to `"role"` and `"value"` to `"content"` (the messages are modified in place). Then
    the `"conversations"` key is renamed to `"messages"`. Examples already in ChatML are returned unchanged.

    Args:
        example (`dict[str, list]`):
            A single dataset row.

    Returns:
        `dict[str, list]`: The converted example.

    Example:
    ```python
    >>> maybe_convert_to_chatml({"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "yo"}]})
    {'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'yo'}]}
    ```
    """
    for key in ("prompt", "completion", "chosen", "rejected", "messages", "conversations"):
        messages = example.get(key)
        if not isinstance(messages, list):
            continue
        for message in messages:
            if not isinstance(message, dict):
                continue
            if "from" in message:
                message["role"] = message.pop("from")
            if "value" in message:
                message["content"] = message.pop("value")
    if "conversations" in example:
        example["messages"] = example.pop("conversations")
    return example


def prepare_multimodal_messages(messages: list[dict[str, Any]], images: list | None = None) -> list[dict[str, Any]]:
    """Convert messages to the typed-content format used by vision-language processors and attach the images.

    String contents become `[{"type": "text", "text": ...}]` for system, developer, user, assistant and tool
    messages. The first user message with string content additionally gets one `{"type": "image"}` placeholder per
    image, before its text. Finally every image placeholder without an image (outside tool messages) receives the
    next image of `images`, in order. The input messages are not modified.

    Args:
        messages (`list[dict[str, Any]]`):
            Conversation to convert.
        images (`list`, *optional*):
            Images (e.g. `PIL.Image.Image`) to insert.

    Returns:
        `list[dict[str, Any]]`: The converted messages.

    Raises:
        ValueError: If a message has an unknown role, or the number of image placeholders does not match the number
            of images.

    Example:
    ```python
    >>> prepare_multimodal_messages([{"role": "user", "content": "What?"}], images=["IMG"])
    [{'role': 'user', 'content': [{'type': 'image', 'image': 'IMG'}, {'type': 'text', 'text': 'What?'}]}]
    ```
    """
    images = list(images) if images is not None else []
    # Copy the containers only: images may be large objects that should not be deep-copied.
    converted = []
    placeholders_added = False
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ALLOWED_ROLES:
            raise ValueError(
                f"Message {index} has role {role!r}, but the role of every message must be one of "
                f"{list(ALLOWED_ROLES)}."
            )
        message = dict(message)
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if role == "user" and not placeholders_added:
                parts = [{"type": "image"} for _ in images] + parts
                placeholders_added = True
            message["content"] = parts
        elif isinstance(content, list):
            message["content"] = [dict(part) if isinstance(part, dict) else part for part in content]
        converted.append(message)

    next_image = 0
    missing = 0
    for message in converted:
        if message["role"] == "tool" or not isinstance(message.get("content"), list):
            continue
        for part in message["content"]:
            if isinstance(part, dict) and part.get("type") == "image" and part.get("image") is None:
                if next_image < len(images):
                    part["image"] = images[next_image]
                    next_image += 1
                else:
                    missing += 1
    if missing or next_image != len(images):
        raise ValueError(
            f"The messages contain {next_image + missing} image placeholder(s) to fill but {len(images)} image(s) "
            "were given. Provide exactly one image per `{'type': 'image'}` placeholder (or let this function add "
            "the placeholders by using string contents)."
        )
    return converted

"""Teacher prompts of the self-distillation trainers: the student's prompt with extra text for the teacher."""

from typing import Any


def message_text(content: Any) -> str:
    """The text of a message's content: a string as is, the text parts of a multimodal list joined by newlines."""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if part.get("type", "text") == "text")
    return "" if content is None else str(content)


def last_user_text(prompt: Any) -> str:
    """The text the teacher template wraps: a string prompt itself, or the last user message of a conversation."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt):
        if message.get("role") == "user":
            return message_text(message.get("content"))
    return message_text(prompt[-1].get("content")) if prompt else ""


def with_teacher_text(prompt: Any, text: str) -> Any:
    """`text` as the teacher's prompt: a string prompt becomes `text`; a conversation keeps its earlier messages and
    ends with a user message holding `text` (in place of its last message)."""
    if isinstance(prompt, str):
        return text
    return [*prompt[:-1], {"role": "user", "content": text}]

"""Recognising a chat template's family by what it renders.

A template is compared with each family's training template on a few probe conversations (plain chat, system
prompt, generation prompt, tool calls with dict and JSON-string arguments, typed content parts): it belongs to the
family when both render the same text, or fail alike, on every probe. Differences in the template source that do
not change the output (whitespace control, comments, a different but equivalent structure) are therefore ignored, and
the date string some templates print is pinned through `date_string`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from .families import ALL_FAMILIES, Family


_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _call(arguments: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]


_USER = {"role": "user", "content": "Hi"}
_SYSTEM = {"role": "system", "content": "Sys"}
_ASSISTANT = {"role": "assistant", "content": "Hello"}

# (messages, keyword arguments). Every probe ends with the turn being learned or with the generation prompt, where
# training variants render what the originals render.
PROBES: tuple[tuple[list[dict[str, Any]], dict[str, Any]], ...] = (
    ([_USER, _ASSISTANT], {}),
    ([_SYSTEM, _USER, _ASSISTANT], {}),
    ([_SYSTEM, _USER], {"add_generation_prompt": True}),
    # The boolean argument tells apart templates that print non-string values differently.
    (
        [_USER, {"role": "assistant", "content": "", "tool_calls": _call({"city": "Paris", "hourly": True})}],
        {"tools": [_WEATHER_TOOL]},
    ),
    (
        [_USER, {"role": "assistant", "content": "", "tool_calls": _call('{"city": "Paris", "hourly": true}')}],
        {"tools": [_WEATHER_TOOL]},
    ),
    (
        [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        ],
        {},
    ),
    (
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        {"add_generation_prompt": True},
    ),
    ([{"role": "system", "content": ""}, _USER, _ASSISTANT], {}),
    ([_USER, {"role": "assistant", "content": "Hello", "reasoning_content": "Think"}], {}),
    # Read by `Family.detect` predicates and by families listing it in `extra_probes`: a tool result followed by the
    # answer (Gemma 4 continues the model turn, Diffusion Gemma opens a new one).
    (
        [
            _USER,
            {"role": "assistant", "content": "", "tool_calls": _call({"city": "Paris"})},
            {"role": "tool", "name": "get_weather", "content": "Sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ],
        {"tools": [_WEATHER_TOOL]},
    ),
)
# Probes compared with every training variant (the others feed `Family.detect` and `Family.extra_probes`).
COMPARED_PROBES = 9


def _render(
    template: str, messages: list[dict[str, Any]], kwargs: dict[str, Any], specials: dict[str, str]
) -> str | None:
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    try:
        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=template,
            date_string="26 Jul 2024",
            **specials,
            **kwargs,
        )
    except Exception:
        return None
    return rendered[0]


@lru_cache(maxsize=64)
def _renderings(template: str, specials: tuple[tuple[str, str], ...]) -> tuple[str | None, ...]:
    return tuple(_render(template, messages, kwargs, dict(specials)) for messages, kwargs in PROBES)


def _strip_stop(rendering: str | None, family: Family) -> str | None:
    for stop in family.trailing_stops:
        if rendering is not None and rendering.endswith(stop):
            return rendering[: -len(stop)]
    return rendering


def _matches(family: Family, template: str, specials: tuple[tuple[str, str], ...]) -> bool:
    if not all(marker in template for marker in family.markers):
        return False
    candidate = _renderings(template, specials)
    if family.detect is not None:
        return family.detect(list(candidate))
    reference = _renderings(family.training_template, specials)
    compared = [i for i in range(COMPARED_PROBES) if i not in family.ignored_probes] + list(family.extra_probes)
    # At least one probe must render: two templates failing on everything tell nothing apart.
    pairs = [(candidate[i], _strip_stop(reference[family.probe_aliases.get(i, i)], family)) for i in compared]
    return any(ref is not None for _, ref in pairs) and all(cand == ref for cand, ref in pairs)


def identify_family(template: str, special_tokens: dict[str, str] | None = None) -> Family | None:
    """The family whose templates render like `template`, or None.

    Args:
        template: Chat template source.
        special_tokens: Values of the template variables `bos_token`, `eos_token`, ... (the tokenizer's).

    Returns:
        The first matching family of `trl._chat.families.ALL_FAMILIES`, else None.
    """
    # A tokenizer without a bos (or eos) token leaves the variable undefined, which some templates concatenate; an
    # empty string renders both kinds of templates alike.
    specials = tuple(sorted({"bos_token": "", "eos_token": "", **(special_tokens or {})}.items()))
    for family in ALL_FAMILIES:
        if _matches(family, template, specials):
            return family
    return None

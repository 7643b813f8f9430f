"""Conversations shared by the chat template tests and parity cases: plain chat, system prompts, multi-turn, generation
prompts, reasoning, tool calls (dict and JSON-string arguments, one or two calls) and typed content parts.

Each entry is `name -> (messages, keyword arguments for apply_chat_template)`. This module only uses the standard
library, so the parity worker can import it under real TRL too.
"""

import json


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name."}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}


def _call(name, arguments, as_string):
    return {
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments) if as_string else arguments},
    }


def _tool_conversation(as_string):
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Paris"}, as_string)]},
        {"role": "tool", "name": "get_weather", "content": "Sunny, 22 degrees."},
        {"role": "assistant", "content": "It is sunny and 22 degrees in Paris."},
    ]


def _two_call_conversation(as_string):
    calls = [_call("get_weather", {"city": "Rome"}, as_string), _call("get_time", {"tz": "Asia/Tokyo"}, as_string)]
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Rome and time in Tokyo?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": calls},
        {"role": "tool", "name": "get_weather", "content": "Rainy."},
        {"role": "tool", "name": "get_time", "content": "09:30"},
        {"role": "assistant", "content": "Rome is rainy and it is 09:30 in Tokyo."},
    ]


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


CONVERSATIONS = {
    "single": ([_user("Hello!"), _assistant("Hi, how can I help?")], {}),
    "system": ([{"role": "system", "content": "Be brief."}, _user("Name a colour."), _assistant("Blue.")], {}),
    "multi_turn": ([_user("2+2?"), _assistant("4."), _user("And 3+3?"), _assistant("6.")], {}),
    "prompt": ([{"role": "system", "content": "Be brief."}, _user("Hi")], {"add_generation_prompt": True}),
    "prompt_after_turn": ([_user("2+2?"), _assistant("4."), _user("And 3+3?")], {"add_generation_prompt": True}),
    "reasoning": (
        [
            _user("2+2?"),
            _assistant("4.", reasoning_content="Two plus two is four."),
            _user("3+3?"),
            _assistant("6.", reasoning_content="Three plus three."),
        ],
        {},
    ),
    "think_inline": ([_user("2+2?"), _assistant("<think>\nEasy sum.\n</think>\n\n4.")], {}),
    "no_thinking": ([_user("2+2?"), _assistant("4.")], {"enable_thinking": False}),
    "no_thinking_prompt": ([_user("2+2?")], {"enable_thinking": False, "add_generation_prompt": True}),
    "tools": (_tool_conversation(False), {"tools": [WEATHER_TOOL]}),
    "tools_str_args": (_tool_conversation(True), {"tools": [WEATHER_TOOL]}),
    "two_calls": (_two_call_conversation(False), {"tools": [WEATHER_TOOL, TIME_TOOL]}),
    "two_calls_str_args": (_two_call_conversation(True), {"tools": [WEATHER_TOOL, TIME_TOOL]}),
    "tools_prompt": (_tool_conversation(False)[:3], {"tools": [WEATHER_TOOL], "add_generation_prompt": True}),
    "tools_no_call": ([_user("Hi"), _assistant("Hello.")], {"tools": [WEATHER_TOOL]}),
    "text_parts": (
        [
            {"role": "user", "content": [{"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        ],
        {},
    ),
    "image_parts": (
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A dog."}]},
        ],
        {},
    ),
}

"""Response parsing schemas (transformers' declarative `response_template` format), one per tool-call syntax.

`tokenizer.parse_response(ids, prefix=...)` matches `start_anchor` in the prompt + completion text, then reads the
fields below from what follows it.
"""

from __future__ import annotations

from typing import Any


def _xml_calls(open_pattern: str, close_pattern: str, tag_pattern: str) -> dict[str, Any]:
    """Repeated XML-style tool calls: `open_pattern` captures the function name (`name`), the arguments are key/value
    tags matched by `tag_pattern` (named groups `key` and `value`; text values, cast when tools are given)."""
    return {
        "open_pattern": open_pattern,
        "close_pattern": close_pattern,
        "repeats": True,
        "content": "xml-inline",
        "content_args": {"tag_pattern": tag_pattern},
        "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
    }


def _chatml_schema(reasoning: bool) -> dict[str, Any]:
    # Hermes-style calls: "<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>" after the text, turn closed by
    # "<|im_end|>" (Qwen 2.5 / 3 / 3.5 families).
    fields: dict[str, Any] = {}
    if reasoning:
        fields["reasoning_content"] = {
            # Only a closed think block is reasoning; an unclosed one is left in the content.
            "open_pattern": r"\s*<think>\n?(?=[\s\S]*</think>)",
            "close_pattern": r"\n?</think>\s*",
            "content": "text",
        }
    fields["tool_calls"] = {
        # The leading whitespace belongs to the separator between content and calls, not to either of them.
        "open_pattern": r"\s*<tool_call>",
        "close": "</tool_call>",
        "repeats": True,
        "content": "json",
        "transform": {"type": "function", "function": "{content}"},
    }
    # Whitespace after the end token is swallowed too: a stray trailing "\n" would otherwise open an empty content
    # region whose close overwrites the real content.
    fields["content"] = {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)\s*", "content": "text"}
    return {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n", "fields": fields}


CHATML_SCHEMA = _chatml_schema(reasoning=False)
CHATML_REASONING_SCHEMA = _chatml_schema(reasoning=True)

# Llama 3.1 / 3.2: a call is a bare JSON object {"name": ..., "parameters": {...}}; its closing brace is the one
# followed by the end of the turn, another call, or the end of the text.
LLAMA3_SCHEMA: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r'\s*\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
            "close_pattern": r"\}(?=\s*(?:<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>|\{\"name\"|$))",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"\s*(?:<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>)\s*", "content": "text"},
    },
}

# DeepSeek-R1-Distill: the generation prompt opens the reasoning ("<｜Assistant｜><think>\n"), the answer follows
# "</think>"; no tool calls.
DEEPSEEK_R1_SCHEMA: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    # The generation prompt already holds the "<think>\n" that opens the reasoning.
    "start_anchor_pattern": r"<｜Assistant｜>(?:<think>\n?)?",
    "fields": {
        "reasoning_content": {
            "open_pattern": r"(?=[\s\S]*</think>)",
            "close_pattern": r"\n?</think>\s*",
            "content": "text",
        },
        "content": {"close_pattern": r"\s*(?:<｜end▁of▁sentence｜>)\s*", "content": "text"},
    },
}

# Qwen3.5 / 3.6 / 3.8: the generation prompt opens the reasoning ("<think>\n"), which runs to "</think>"; calls are
# "<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...</function>\n</tool_call>" (values are text,
# cast to the declared types when the tools are given).
QWEN3_5_SCHEMA: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"<\|im_start\|>assistant\n(?:<think>\n)?",
    "fields": {
        # The answer starts inside the reasoning (the prompt opened it); an unclosed think block stays reasoning.
        "reasoning_content": {"open_pattern": r"^", "close_pattern": r"\s*</think>\s*", "content": "text"},
        "tool_calls": _xml_calls(
            r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>\n?",
            r"</function>\s*</tool_call>",
            r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>",
        ),
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)\s*", "content": "text"},
    },
}

# GPT-OSS (harmony): after the "<|start|>assistant" of the prompt come an optional analysis message, then a final
# answer ("<|channel|>final<|message|>...<|return|>") or a call (" to=functions.NAME<|channel|>commentary
# json<|message|>{...}<|call|>"); later messages repeat "<|start|>assistant". Text outside these messages is dropped.
GPT_OSS_SCHEMA: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start|>assistant",
    "fields": {
        "thinking": {
            "open_pattern": r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>",
            "close": "<|end|>",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"(?:<\|start\|>assistant)?\s*to=functions\.(?P<name>[^<\s]+)\s*"
            r"<\|channel\|>commentary(?: json)?<\|message\|>",
            "close": "<|call|>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {
            "open_pattern": r"(?:<\|start\|>assistant)?<\|channel\|>final<\|message\|>",
            "close": "<|return|>",
            "content": "text",
        },
    },
}

# GLM-4-MoE: "\n<think>...</think>" then the answer and calls "<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V
# </arg_value>\n...</tool_call>"; the turn ends with the next role token ("<|user|>", or "<|observation|>" after calls,
# which TRL leaves in the content).
GLM4_MOE_SCHEMA: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "reasoning_content": {"open_pattern": r"\s*<think>", "close": "</think>", "content": "text"},
        "tool_calls": _xml_calls(
            r"\s*<tool_call>(?P<name>[^\n<]+)\n?",
            r"</tool_call>",
            r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>",
        ),
        "content": {"close_pattern": r"\s*<\|user\|>\s*", "content": "text"},
    },
}

# LFM2 (tool-calling revision): optional "<think>...</think>" ("thinking"), then text and Python-style calls
# "<|tool_call_start|>[name(key='value'), ...]<|tool_call_end|>"; the turn ends with "<|im_end|>".
LFM2_SCHEMA: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": {"open_pattern": r"\s*<think>", "close": "</think>", "content": "text"},
        "tool_calls": {
            "open_pattern": r"\s*<\|tool_call_start\|>",
            "close": "<|tool_call_end|>",
            "content": "python-call-list",
        },
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>)\s*", "content": "text"},
    },
}

# Nemotron 3: Qwen3.5's syntax, except that a think block without "</think>" is left in the content.
NEMOTRON_3_SCHEMA: dict[str, Any] = {
    **QWEN3_5_SCHEMA,
    "fields": {
        **QWEN3_5_SCHEMA["fields"],
        "reasoning_content": {
            "open_pattern": r"^(?=[\s\S]*</think>)",
            "close_pattern": r"\s*</think>\s*",
            "content": "text",
        },
    },
}

# Gemma 4: an optional thought channel ("<|channel>thought\n...<channel|>"), the answer, and calls
# "<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>" (bare keys, strings between '<|"|>' delimiters). The turn
# ends with "<turn|>", or with "<|tool_response>" after calls. A completion continuing after a tool result starts at
# "<tool_response|>" instead of the "<|turn>model\n" of the prompt.
GEMMA4_SCHEMA: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": ["<|turn>model\n", "<tool_response|>"],
    "fields": {
        "reasoning_content": {"open": "<|channel>thought\n", "close": "<channel|>", "content": "text"},
        "tool_calls": {
            "open_pattern": r"<\|tool_call>call:(?P<name>[^{<\s]+)",
            "close": "<tool_call|>",
            "repeats": True,
            "content": "json",
            "content_args": {"unquoted_keys": True, "string_delims": [['<|"|>', '<|"|>']]},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close": ["<turn|>", "<|tool_response>", "<eos>"], "content": "text"},
    },
}

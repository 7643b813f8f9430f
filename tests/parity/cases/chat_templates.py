"""Parity cases: chat template families (trl.chat_template_utils) on the vendors' original templates.

The originals are read from the parity venv's `trl` package data (the real TRL ships them); both sides load the same
files, so each case compares what TRL's training path and ours make of the same tokenizer: the training variant's
text and assistant mask on the shared conversations, the template property checks, response parsing, and SFT's
`assistant_only_loss` labels.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from functools import partial

from . import COMMON_ARGS, QWEN, expect_error, register, to_jsonable


def _conversations() -> dict:
    # Shared with the unit tests; loaded by path because the worker only has tests/parity on sys.path.
    path = os.path.join(os.path.dirname(__file__), "..", "..", "chat_template_conversations.py")
    spec = importlib.util.spec_from_file_location("chat_template_conversations", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CONVERSATIONS


def _original(name: str) -> str:
    roots = [os.environ.get("PARITY_VENV"), os.path.join(os.path.dirname(__file__), "..", "..", "..", ".venv-parity")]
    for root in filter(None, roots):
        for folder in glob.glob(os.path.join(root, "lib", "python*", "site-packages", "trl", "chat_templates")):
            path = os.path.join(folder, f"{name}.jinja")
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    return f.read()
    import trl  # under real TRL the package itself holds them

    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


FAMILIES = [
    "qwen2_5",
    "qwen3",
    "qwen3_instruct_2507",
    "qwen3_5_think",
    "qwen3_5_nothink",
    "qwen3_6",
    "qwen3_8",
    "llama3",
    "llama3_1",
    "llama3_2",
    "gemma",
    "gemma3",
    "phi3",
    "phi3_5",
    "deepseekv3",
    "deepseek_r1_distill",
    "gptoss",
    "glm4moe",
    "cohere",
    "lfm2",
    "idefics3",
    "smolvlm",
    "llava_next",
    "cohere2",
    "lfm2_v2",
    "lfm2_2_5",
    "lfm2_2_5_v2",
    "qwen2_5_vl",
    "qwen3_vl",
    "nemotron_3_nano",
    "nemotron_3_super",
    "nemotron_3_ultra",
    "nemotron_3_5_lightning",
    "gemma4",
    "gemma4_v2",
    "gemma4_v3",
    "gemma4_v4",
    "gemma4_v5",
    "muse_glimmer",
    "diffusion_gemma",
]
WITH_SCHEMA = [
    "qwen2_5",
    "qwen3",
    "qwen3_instruct_2507",
    "qwen3_5_think",
    "qwen3_6",
    "qwen3_8",
    "llama3_1",
    "deepseek_r1_distill",
    "gptoss",
    "glm4moe",
    "lfm2_v2",
    "lfm2_2_5",
    "qwen3_vl",
    "nemotron_3_nano",
]
# Gemma 4: response schema only (TRL has no training variant for it).
GEMMA4 = ["gemma4", "gemma4_v2", "gemma4_v3", "gemma4_v4", "gemma4_v5"]
# Training variant and tool calls, but no response schema in TRL.
WITHOUT_SCHEMA = ["muse_glimmer", "diffusion_gemma"]


def _tokenizer(ctx, family: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ctx.tokenizer("llama3" if family.startswith("llama") else "qwen2_5"))
    tok.chat_template = _original(family)
    return tok


def _training(ctx, family: str) -> dict:
    from trl import get_training_chat_template

    tok = _tokenizer(ctx, family)

    def run():
        template = get_training_chat_template(tok)
        out = {"returned_none": template is None}
        for name, (messages, kwargs) in _conversations().items():
            kwargs = dict(kwargs)
            tools = kwargs.pop("tools", None)

            def render(messages=messages, tools=tools, kwargs=kwargs):
                encoded = tok.apply_chat_template(
                    messages,
                    tools=tools,
                    chat_template=template,
                    tokenize=True,
                    return_dict=True,
                    return_assistant_tokens_mask=True,
                    **kwargs,
                )
                return {"ids": list(encoded["input_ids"]), "mask": list(encoded["assistant_masks"])}

            out[name] = expect_error(render)
        return out

    return expect_error(run)


def _inspection(ctx, family: str) -> dict:
    from trl import supports_tool_calling
    from trl.chat_template_utils import (
        has_generation_markers,
        is_chat_template_prefix_preserving,
        is_chat_template_stop_token_trained,
    )

    tok = _tokenizer(ctx, family)
    return {
        "has_generation_markers": has_generation_markers(tok.chat_template),
        "supports_tool_calling": expect_error(lambda: supports_tool_calling(tok)),
        "prefix_preserving": expect_error(lambda: is_chat_template_prefix_preserving(tok)),
        "stop_token_trained": expect_error(lambda: is_chat_template_stop_token_trained(tok)),
    }


_COMPLETIONS = [
    "Plain answer.<|im_end|>",
    "<think>\nLet me think.\n</think>\n\nHello there.<|im_end|>",
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    "Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
    "Hello.<|eot_id|>",
    "hmm\n</think>\n\nAnswer.<｜end▁of▁sentence｜>",
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>"
    'commentary json<|message|>{"city": "Paris"}<|call|>',
    "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi.<|return|>",
    "\n<think>Hmm.</think>\nSure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "</tool_call><|observation|>",
    "Sure.<|tool_call_start|>[get_weather(city='Paris', days=3)]<|tool_call_end|><|im_end|>",
]


_GEMMA4_COMPLETIONS = [
    "Plain answer.<turn|>",
    "<|channel>thought\nLet me think.\n<channel|>Hello there.<turn|>",
    'Sure.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,hourly:true}<tool_call|><|tool_response>',
    '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|><|tool_call>call:get_time{tz:<|"|>Asia/Tokyo<|"|>}'
    "<tool_call|><|tool_response>",
    '<|channel>thought\nNeed weather.<channel|><|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,'
    'opts:{units:<|"|>metric<|"|>,list:[1,2]}}<tool_call|><|tool_response>',
    "Answer without end",
    "<|turn>model\nHello again.<turn|>",
    "Done.<eos>",
]


def _parsing(ctx, family: str, completions: list[str] = _COMPLETIONS) -> dict:
    from trl import add_response_schema
    from trl.chat_template_utils import parse_response

    tok = _tokenizer(ctx, family)
    add_response_schema(tok)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    out = {}
    for i, text in enumerate(completions):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out[str(i)] = {
            "with_prefix": expect_error(lambda ids=ids: parse_response(tok, ids, prefix=list(prompt))),
            "without_prefix": expect_error(lambda ids=ids: parse_response(tok, ids)),
        }
    return out


def _no_schema(ctx, family: str) -> dict:
    from trl import add_response_schema

    tok = _tokenizer(ctx, family)
    return expect_error(lambda: add_response_schema(tok))


def _sft_labels(ctx, family: str) -> dict:
    from datasets import Dataset

    from trl import SFTConfig, SFTTrainer

    messages = _conversations()["multi_turn"][0]
    tok = _tokenizer(ctx, family)
    args = SFTConfig(output_dir=ctx.tmpdir(), assistant_only_loss=True, **COMMON_ARGS)
    trainer = SFTTrainer(
        model=ctx.model(QWEN),
        args=args,
        train_dataset=Dataset.from_dict({"messages": [messages] * 4}),
        processing_class=tok,
    )
    row = trainer.train_dataset[0]
    return to_jsonable({"input_ids": row["input_ids"], "labels": row["labels"]})


for _family in FAMILIES:
    phrases = ("not training-compatible",) if _family in ("llama3_1", "llama3_2", *GEMMA4) else ()
    register(f"chat_templates/training/{_family}", partial(_training, family=_family), phrases)
    register(f"chat_templates/inspection/{_family}", partial(_inspection, family=_family))
for _family in WITH_SCHEMA:
    register(f"chat_templates/parse/{_family}", partial(_parsing, family=_family))
for _family in GEMMA4:
    register(f"chat_templates/parse/{_family}", partial(_parsing, family=_family, completions=_GEMMA4_COMPLETIONS))
for _family in WITHOUT_SCHEMA:
    register(
        f"chat_templates/parse/{_family}", partial(_no_schema, family=_family), ("failed to add response schema",)
    )
for _family in ("qwen3", "gemma3", *WITHOUT_SCHEMA):
    register(f"chat_templates/sft/{_family}", partial(_sft_labels, family=_family))

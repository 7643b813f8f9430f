"""Parity cases: Data utilities (trl.data_utils, trl.chat_template_utils)."""

from __future__ import annotations

from functools import partial

from . import (
    QWEN,
    case,
    expect_error,
    register,
    to_jsonable,
    tokenizer,
)


# ---------------------------------------------------------------------------------------------------------------------
# Data utilities (trl.data_utils, trl.chat_template_utils)
# ---------------------------------------------------------------------------------------------------------------------
def _rows(dataset) -> list[dict]:
    return to_jsonable(dataset.to_list())


def chat_template_case(ctx, dataset: str, tokenizer_name: str = "qwen2_5") -> dict:
    from transformers import AutoTokenizer

    from trl import apply_chat_template, maybe_apply_chat_template

    tok = AutoTokenizer.from_pretrained(ctx.tokenizer(tokenizer_name))
    rows = ctx.dataset(dataset, "train", 4).to_list()
    return to_jsonable(
        {
            "apply": [apply_chat_template(row, tok) for row in rows],
            "maybe_apply": [maybe_apply_chat_template(row, tok) for row in rows],
        }
    )


for _ds in [
    "conversational_language_modeling",
    "conversational_prompt_only",
    "conversational_prompt_completion",
    "conversational_preference",
    "conversational_implicit_prompt_preference",
    "conversational_unpaired_preference",
]:
    register(f"data_utils/apply_chat_template/{_ds}", partial(chat_template_case, dataset=_ds))
register(
    "data_utils/apply_chat_template/llama3/conversational_preference",
    partial(chat_template_case, dataset="conversational_preference", tokenizer_name="llama3"),
)


@case("data_utils/apply_chat_template/tools")
def _apply_chat_template_tools(ctx):
    from transformers import AutoTokenizer

    from trl import apply_chat_template

    tok = AutoTokenizer.from_pretrained(ctx.tokenizer("qwen2_5"))
    rows = ctx.dataset("conversational_language_modeling_tools", "train", 3).to_list()
    return to_jsonable([apply_chat_template({"messages": r["messages"]}, tok, tools=r["tools"]) for r in rows])


@case("data_utils/maybe_apply_chat_template/standard")
def _maybe_apply_standard(ctx):
    from trl import maybe_apply_chat_template

    tok = tokenizer(ctx)
    rows = ctx.dataset("standard_preference", "train", 3).to_list()
    return to_jsonable([maybe_apply_chat_template(row, tok) for row in rows])


@case("data_utils/is_conversational")
def _is_conversational(ctx):
    from trl import is_conversational

    out = {}
    for name in [
        "standard_language_modeling",
        "standard_preference",
        "conversational_language_modeling",
        "conversational_prompt_only",
        "conversational_unpaired_preference",
    ]:
        out[name] = is_conversational(ctx.dataset(name, "train", 1)[0])
    return out


@case("data_utils/extract_prompt")
def _extract_prompt(ctx):
    from trl import extract_prompt, maybe_extract_prompt

    out = {}
    for name in ["standard_implicit_prompt_preference", "conversational_implicit_prompt_preference"]:
        ds = ctx.dataset(name, "train", 4)
        out[name] = [extract_prompt(row) for row in ds.to_list()]
        out[f"{name}/map"] = _rows(ds.map(maybe_extract_prompt))
    explicit = ctx.dataset("standard_preference", "train", 2)
    out["explicit_unchanged"] = _rows(explicit.map(maybe_extract_prompt))
    return to_jsonable(out)


@case("data_utils/unpair_preference_dataset")
def _unpair(ctx):
    from trl import maybe_unpair_preference_dataset, unpair_preference_dataset

    out = {}
    for name in ["standard_preference", "conversational_preference"]:
        ds = ctx.dataset(name, "train", 4)
        out[name] = _rows(unpair_preference_dataset(ds))
        out[f"{name}/maybe"] = _rows(maybe_unpair_preference_dataset(ds))
    unpaired = ctx.dataset("standard_unpaired_preference", "train", 2)
    out["unpaired_unchanged"] = _rows(maybe_unpair_preference_dataset(unpaired))
    return out


def _tokenized_lm(ctx, n: int = 16):
    tok = tokenizer(ctx)
    ds = ctx.dataset("standard_language_modeling", "train", n)
    return ds.map(lambda row: {"input_ids": tok(row["text"])["input_ids"]}, remove_columns=["text"])


for _strategy in ["bfd", "bfd_split", "wrapped"]:

    def _pack(ctx, strategy=_strategy):
        from trl import pack_dataset

        ds = _tokenized_lm(ctx)
        packed = pack_dataset(ds, seq_length=12, strategy=strategy)
        return {"columns": sorted(packed.column_names), "rows": _rows(packed)}

    register(f"data_utils/pack_dataset/strategy={_strategy}", _pack)


@case("data_utils/pack_dataset/torch_format")
def _pack_torch_format(ctx):
    from trl import pack_dataset

    ds = _tokenized_lm(ctx, 8).with_format("torch")
    packed = pack_dataset(ds, seq_length=10, strategy="bfd")
    return {"format": packed.format["type"], "columns": sorted(packed.column_names), "first": to_jsonable(packed[0])}


@case("data_utils/maybe_convert_to_chatml")
def _convert_to_chatml(ctx):
    from trl import is_conversational_from_value, maybe_convert_to_chatml

    example = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "user", "value": "What is 2 + 2?"},
            {"from": "assistant", "value": "4"},
        ]
    }
    return {"is_from_value": is_conversational_from_value(example), "converted": maybe_convert_to_chatml(example)}


@case("data_utils/prepare_multimodal_messages")
def _prepare_multimodal(ctx):
    from trl import prepare_multimodal_messages

    messages = ctx.dataset("conversational_language_modeling", "train", 1)[0]["messages"]
    return to_jsonable(prepare_multimodal_messages(messages, images=["IMG0", "IMG1"]))


@case("data_utils/common_prefix_length")
def _common_prefix(ctx):
    from trl.data_utils import common_prefix_length

    return {
        "partial": common_prefix_length([1, 2, 3, 4], [1, 2, 5]),
        "equal": common_prefix_length([1, 2], [1, 2]),
        "none": common_prefix_length([3], [1, 2]),
        "empty": common_prefix_length([], [1]),
    }


@case("chat_template_utils/inspection")
def _template_inspection(ctx):
    from transformers import AutoTokenizer

    from trl import supports_tool_calling
    from trl.chat_template_utils import (
        has_generation_markers,
        is_chat_template_prefix_preserving,
        is_chat_template_stop_token_trained,
    )

    out = {}
    for name in ["qwen2_5", "llama3"]:
        tok = AutoTokenizer.from_pretrained(ctx.tokenizer(name))
        out[name] = {
            "has_generation_markers": has_generation_markers(tok.chat_template),
            "supports_tool_calling": supports_tool_calling(tok),
            "prefix_preserving": is_chat_template_prefix_preserving(tok),
            "stop_token_trained": is_chat_template_stop_token_trained(tok),
        }
    return out


def _training_template(ctx, tokenizer_name: str) -> dict:
    from transformers import AutoTokenizer

    from trl import get_training_chat_template
    from trl.chat_template_utils import has_generation_markers

    messages = ctx.dataset("conversational_language_modeling", "train", 1)[0]["messages"]
    tok = AutoTokenizer.from_pretrained(ctx.tokenizer(tokenizer_name))

    def run():
        template = get_training_chat_template(tok)
        if template is None:
            return {"returned": None}
        rendered = tok.apply_chat_template(
            messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        plain = tok.apply_chat_template(messages, tokenize=True, return_dict=True)
        return {
            "has_generation_markers": has_generation_markers(template),
            "same_ids_as_template": list(rendered["input_ids"]) == list(plain["input_ids"]),
            "assistant_masks": list(rendered["assistant_masks"]),
        }

    return expect_error(run)


for _tok in ["qwen2_5", "llama3"]:
    register(
        f"chat_template_utils/get_training_chat_template/{_tok}", partial(_training_template, tokenizer_name=_tok)
    )


@case("chat_template_utils/clone_chat_template")
def _clone_template(ctx):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl import clone_chat_template

    model = AutoModelForCausalLM.from_pretrained(ctx.model(QWEN))
    tok = AutoTokenizer.from_pretrained(ctx.model(QWEN))
    model, tok, added = clone_chat_template(model, tok, ctx.tokenizer("llama3"))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    return to_jsonable(
        {
            "added_count": len(added),
            "vocab": len(tok),
            "embeddings": model.get_input_embeddings().weight.shape[0],
            "eos_token": tok.eos_token,
            "eos_token_id": model.config.eos_token_id,
            "rendered": tok.apply_chat_template(messages, tokenize=False),
        }
    )


@case("chat_template_utils/add_response_schema")
def _response_schema(ctx):
    from transformers import AutoTokenizer

    from trl import add_response_schema

    return {
        name: expect_error(lambda name=name: add_response_schema(AutoTokenizer.from_pretrained(ctx.tokenizer(name))))
        for name in ["qwen2_5", "llama3"]
    }


@case("chat_template_utils/parse_response")
def _parse_response(ctx):
    from transformers import AutoTokenizer

    from trl.chat_template_utils import parse_response

    tok = AutoTokenizer.from_pretrained(ctx.tokenizer("qwen2_5"))
    texts = [
        "The answer is 4.<|im_end|>",
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
    ]
    return {str(i): expect_error(lambda t=t: parse_response(tok, tok(t)["input_ids"])) for i, t in enumerate(texts)}


# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------
# Throughput accounting (trl.trainer.utils): FLOPs per token, MFU, peak FLOP/s
# ---------------------------------------------------------------------------------------------------------------------
@case("data_utils/flops_and_mfu")
def _flops_and_mfu(ctx):
    from transformers import LlamaConfig, Qwen2Config

    from trl.trainer.utils import adjusted_mfu, compute_flops_per_token, compute_mfu, get_peak_flops

    configs = {
        "qwen2_gqa": Qwen2Config(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            num_hidden_layers=3,
            vocab_size=1000,
        ),
        "qwen2_head_dim": Qwen2Config(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=48,
            intermediate_size=256,
            num_hidden_layers=3,
            vocab_size=1000,
        ),
        "qwen2_tied": Qwen2Config(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=256,
            num_hidden_layers=2,
            vocab_size=1000,
            tie_word_embeddings=True,
        ),
        "llama": LlamaConfig(
            hidden_size=96,
            num_attention_heads=3,
            num_key_value_heads=1,
            intermediate_size=200,
            num_hidden_layers=2,
            vocab_size=500,
        ),
    }
    out = {}
    for name, config in configs.items():
        out[name] = {
            "flops_per_token": [compute_flops_per_token(config, s) for s in (0, 7, 128)],
            "adjusted_mfu": [adjusted_mfu(50.0, config, s) for s in (0, 7, 128)],
        }
    out["mfu"] = [compute_mfu(1000, 10.0, 2, 1e4), compute_mfu(123456, 789.0, 8, 312e12)]
    out["peak"] = {
        f"{device}|{dtype}": get_peak_flops(device, dtype)
        for device in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S", "Tesla T4", "cpu")
        for dtype in ("bfloat16", "float16", "float32")
    }
    return out

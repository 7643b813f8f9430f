"""GRPO's multi-turn tool loop with the tool-call syntaxes of TRL's chat template families: the call is parsed from
the completion with the family's response schema, the tool runs, its result is appended and generation continues.
(The ChatML / Hermes JSON syntax of Qwen 2.5 / 3 / 3-VL is covered by `test_grpo_tools.py`.)

Every family with a response schema is here, one entry per distinct syntax. The families without one (DeepSeek-V3,
Cohere, Cohere 2, Phi-3, Gemma 3, Muse Glimmer, Diffusion Gemma; none in TRL either) cannot parse a tool call.

Markers the tiny tokenizers lack are either plain text (ChatML-turn families, whose end-of-turn token exists) or,
where the loop needs them as single tokens (the turn starts the scripted replies follow, the stop tokens generation
ends on), added to a copy of the tokenizer as special tokens, with the model's embeddings resized.
"""

import copy
import warnings
from dataclasses import dataclass

import pytest
from test_chat_template_families import VENDOR_DIR
from test_grpo_tools import Recorder, ScriptedReplies, chat_dataset, make_args, make_multiply, train_log
from trainer_utils import requires_response_parser
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl import GRPOTrainer
from trl import chat_template_utils as ctu
from trl.assets import get_model_path, get_tokenizer_path


pytestmark = [pytest.mark.usefixtures("single_thread"), requires_response_parser]


@dataclass(frozen=True)
class Syntax:
    """A tool-call syntax: the chat template writing it and the scripted turns of a call, then an answer."""

    template: str | None  # None: the vendor's original (`vendor_template`), read from the parity venv
    turn_starts: tuple[str, ...]  # what precedes each assistant turn (generation prompt, continuation after a result)
    stops: tuple[str, ...]  # end-of-turn tokens; the first one ends the answer
    call: str  # the first turn (ends with its own stop token when it is not the first of `stops`)
    answer: str = "It is 12."  # the second turn, before `stops[0]`
    answer_content: str = "It is 12."  # its parsed content
    added_tokens: tuple[str, ...] = ()  # markers added to the tokenizer as special tokens
    vendor_template: str | None = None
    tokenizer: str = "qwen2_5"
    model: str = "tiny-Qwen2ForCausalLM"


GPT_OSS_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
GLM_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
GEMMA4_TOKENS = (
    "<|turn>",
    "<turn|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
    "<|channel>",
    "<channel|>",
)

SYNTAXES = {
    # The no-think generation prompt writes an empty think block before each turn.
    "qwen3_5_xml": Syntax(
        ctu.qwen3_5_nothink_chat_template,
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n",),
        ("<|im_end|>",),
        "<tool_call>\n<function=multiply>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\n4\n</parameter>\n"
        "</function>\n</tool_call>",
    ),
    # Nemotron 3: Qwen3.5's call syntax in its own template (reasoning opened by the generation prompt).
    "nemotron_3_xml": Syntax(
        ctu.nemotron_3_nano_chat_template,
        ("<|im_start|>assistant\n<think>\n",),
        ("<|im_end|>",),
        "</think>\n<tool_call>\n<function=multiply>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\n4\n"
        "</parameter>\n</function>\n</tool_call>",
        answer="</think>\nIt is 12.",
    ),
    "lfm2_python": Syntax(
        ctu.lfm2_v2_chat_template,
        ("<|im_start|>assistant\n",),
        ("<|im_end|>",),
        "<|tool_call_start|>[multiply(a=3, b=4)]<|tool_call_end|>",
    ),
    "llama_json": Syntax(
        ctu.tiny_llama3_chat_template,
        ("<|start_header_id|>assistant<|end_header_id|>\n\n",),
        ("<|eot_id|>",),
        '{"name": "multiply", "parameters": {"a": 3, "b": 4}}',
        tokenizer="llama3",
        model="tiny-LlamaForCausalLM",
    ),
    # Harmony: a call is a commentary message to the function, ended by "<|call|>"; the answer a final message.
    "gpt_oss_harmony": Syntax(
        ctu.gptoss_chat_template,
        ("<|start|>assistant",),
        ("<|return|>", "<|call|>"),
        ' to=functions.multiply<|channel|>commentary json<|message|>{"a": 3, "b": 4}<|call|>',
        answer="<|channel|>final<|message|>It is 12.",
        added_tokens=GPT_OSS_TOKENS,
    ),
    # GLM-4-MoE: key/value tags; a turn ends with the next role token ("<|observation|>" after calls), which the
    # original template writes only once a message follows (TRL's training variant, which always writes it, is not
    # recognised by `add_response_schema`, as in TRL).
    "glm4_moe_xml": Syntax(
        None,
        ("<|assistant|>",),
        ("<|user|>", "<|observation|>"),
        "\n<think></think>\n<tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>3</arg_value>\n<arg_key>b</arg_key>\n"
        "<arg_value>4</arg_value>\n</tool_call><|observation|>",
        answer="\n<think></think>\nIt is 12.",
        added_tokens=GLM_TOKENS,
        vendor_template="glm4moe",
    ),
    # Gemma 4: bare-key calls ended by "<|tool_response>"; the answer continues the model turn after the result.
    "gemma4_call": Syntax(
        None,
        ("<|turn>model\n", "<tool_response|>"),
        ("<turn|>", "<|tool_response>"),
        "<|tool_call>call:multiply{a:3,b:4}<tool_call|><|tool_response>",
        added_tokens=GEMMA4_TOKENS,
        vendor_template="gemma4_v5",
    ),
}


def _skip_unless_parsable(tokenizer):
    """The installed transformers' response parser must know the family's content types (LFM2's needs 5.24)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ctu.add_response_schema(copy.deepcopy(tokenizer))
        except ValueError:
            return  # no schema for this template: the trainer's own path decides
    for warning in caught:
        if "responses:" in str(warning.message):
            pytest.skip(str(warning.message))


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
def test_tool_loop_per_syntax(tmp_path, syntax):
    spec = SYNTAXES[syntax]
    tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_path(spec.tokenizer))
    template = spec.template
    if template is None:
        if VENDOR_DIR is None:
            pytest.skip("the vendor's original template comes from the parity venv's trl package, not installed")
        template = (VENDOR_DIR / f"{spec.vendor_template}.jinja").read_text(encoding="utf-8")
    tokenizer.chat_template = template
    _skip_unless_parsable(tokenizer)
    model = get_model_path(spec.model)
    if spec.added_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(spec.added_tokens)})
        model = AutoModelForCausalLM.from_pretrained(model)
        model.resize_token_embeddings(len(tokenizer))
    stop_ids = tokenizer.convert_tokens_to_ids(list(spec.stops))
    if len(stop_ids) > 1:  # the family's own stop tokens end generation, as its generation config would say
        model = AutoModelForCausalLM.from_pretrained(model) if isinstance(model, str) else model
        model.generation_config.eos_token_id = stop_ids
    calls, recorder = [], Recorder()
    trainer = GRPOTrainer(
        model,
        reward_funcs=recorder,
        args=make_args(tmp_path, max_completion_length=128),
        train_dataset=chat_dataset("What is 3 times 4?", "Compute 3*4."),
        processing_class=tokenizer,
        tools=[make_multiply(calls)],
    )
    scripted = ScriptedReplies(trainer, lambda text, turn: spec.call if turn == 0 else spec.answer)
    scripted.starts = [tokenizer(start, add_special_tokens=False)["input_ids"] for start in spec.turn_starts]
    scripted.eos = stop_ids[0]
    trainer.train()

    assert calls == [(3, 4)] * 4  # parsed with the family's schema, text arguments cast to the declared types
    (record,) = recorder.calls
    for conversation in record["completions"]:
        first_turn, tool_result, answer = conversation
        assert first_turn["tool_calls"] == [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
        ]
        assert tool_result == {"role": "tool", "name": "multiply", "content": "12"}
        assert answer["content"] == spec.answer_content
    # The result was appended in the family's format, and the answer generated after it.
    text = tokenizer.decode(trainer._buffered_inputs[0]["completion_ids"][0])
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 times 4?"}, *record["completions"][0][:2]],
        tools=[make_multiply([])],
        tokenize=False,
        add_generation_prompt=True,
    )
    glue_end = rendered[-40:]
    assert glue_end.rstrip() in text.replace(spec.answer, "")
    assert text.index("12") < text.rindex(spec.answer_content)
    logged = train_log(trainer)
    assert logged["tools/call_frequency"] == 1.0
    assert logged["tools/failure_frequency"] == 0.0


class _LazyStopTemplate:
    """A processing class whose template writes the end of an assistant turn ("<|obs|>") only when a message
    follows, and whose last turn's content already holds that token."""

    def apply_chat_template(self, messages, add_generation_prompt=False, **kwargs):
        text = "".join(
            f"<|{m['role']}|>{m['content']}" + ("<|obs|>" if m["role"] == "assistant" else "") for m in messages
        )
        if messages[-1]["role"] == "assistant":
            text = text[: -len("<|obs|>")]
        return text + ("<|assistant|>" if add_generation_prompt else "")


def test_tool_glue_with_an_end_of_turn_written_only_before_the_next_message():
    from types import SimpleNamespace

    from trl.trainer.tool_calling import _ToolCallingMixin

    trainer = SimpleNamespace(processing_class=_LazyStopTemplate(), chat_template_kwargs={})
    conversation = [{"role": "assistant", "content": "<|obs|>call"}]
    glue = _ToolCallingMixin._tool_glue_text(
        trainer,
        [{"role": "user", "content": "q"}],
        conversation,
        [{"role": "tool", "content": "12"}],
        [],
        {},
        "<|obs|>",
    )
    assert glue == "<|tool|>12<|assistant|>"  # not the turn's text after the "<|obs|>" of its content

"""GRPO's multi-turn tool loop with the tool-call syntaxes of TRL's chat template families: the call is parsed from
the completion with the family's response schema, the tool runs, its result is appended and generation continues.
(The ChatML / Hermes JSON syntax is covered by `test_grpo_tools.py`.)"""

import pytest
from test_grpo_tools import Recorder, ScriptedReplies, chat_dataset, make_args, make_multiply, train_log
from transformers import AutoTokenizer

from trl import GRPOTrainer
from trl import chat_template_utils as ctu
from trl.assets import get_model_path, get_tokenizer_path


pytestmark = pytest.mark.usefixtures("single_thread")

# syntax -> (tokenizer, model, chat template, what the generation prompt ends with, end-of-turn token, the call)
SYNTAXES = {
    # The no-think generation prompt writes an empty think block before each turn.
    "qwen3_5_xml": (
        "qwen2_5",
        "tiny-Qwen2ForCausalLM",
        ctu.qwen3_5_nothink_chat_template,
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "<|im_end|>",
        "<tool_call>\n<function=multiply>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\n4\n</parameter>\n"
        "</function>\n</tool_call>",
    ),
    "lfm2_python": (
        "qwen2_5",
        "tiny-Qwen2ForCausalLM",
        ctu.lfm2_v2_chat_template,
        "<|im_start|>assistant\n",
        "<|im_end|>",
        "<|tool_call_start|>[multiply(a=3, b=4)]<|tool_call_end|>",
    ),
    "llama_json": (
        "llama3",
        "tiny-LlamaForCausalLM",
        ctu.tiny_llama3_chat_template,
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
        '{"name": "multiply", "parameters": {"a": 3, "b": 4}}',
    ),
}


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
def test_tool_loop_per_syntax(tmp_path, syntax):
    tokenizer_name, model_name, template, turn_start, end_of_turn, call = SYNTAXES[syntax]
    tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_path(tokenizer_name))
    tokenizer.chat_template = template
    calls, recorder = [], Recorder()
    trainer = GRPOTrainer(
        get_model_path(model_name),
        reward_funcs=recorder,
        args=make_args(tmp_path, max_completion_length=128),
        train_dataset=chat_dataset("What is 3 times 4?", "Compute 3*4."),
        processing_class=tokenizer,
        tools=[make_multiply(calls)],
    )
    scripted = ScriptedReplies(trainer, lambda text, turn: call if turn == 0 else "It is 12.")
    scripted.start = tokenizer(turn_start, add_special_tokens=False)["input_ids"]
    scripted.eos = tokenizer.convert_tokens_to_ids(end_of_turn)
    trainer.train()

    assert calls == [(3, 4)] * 4  # parsed with the family's schema, text arguments cast to the declared types
    (record,) = recorder.calls
    first_turn, tool_result, answer = record["completions"][0]
    assert first_turn["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    ]
    assert tool_result == {"role": "tool", "name": "multiply", "content": "12"}
    assert answer["content"] == "It is 12."
    assert train_log(trainer)["tools/call_frequency"] == 1.0

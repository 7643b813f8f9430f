"""GRPO's multi-turn tool loop with the tool-call syntaxes of TRL's chat template families: the call is parsed from
the completion with the family's response schema, the tool runs, its result is appended and generation continues.
(The ChatML / Hermes JSON syntax is covered by `test_grpo_tools.py`.)"""

import pytest
from test_grpo_tools import Recorder, ScriptedReplies, chat_dataset, make_args, make_multiply, train_log
from transformers import AutoTokenizer

from trl import GRPOTrainer
from trl import chat_template_utils as ctu
from trl.assets import get_tokenizer_path


pytestmark = pytest.mark.usefixtures("single_thread")

XML_CALL = "<tool_call>\n<function=multiply>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\n4\n</parameter>\n</function>\n</tool_call>"


def test_tool_loop_with_the_qwen3_5_xml_syntax(tmp_path, model_path):
    tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_path("qwen2_5"))
    tokenizer.chat_template = ctu.qwen3_5_nothink_chat_template
    calls, recorder = [], Recorder()
    trainer = GRPOTrainer(
        model_path,
        reward_funcs=recorder,
        args=make_args(tmp_path, max_completion_length=128),
        train_dataset=chat_dataset("What is 3 times 4?", "Compute 3*4."),
        processing_class=tokenizer,
        tools=[make_multiply(calls)],
    )
    scripted = ScriptedReplies(trainer, lambda text, turn: XML_CALL if turn == 0 else "It is 12.")
    # Each assistant turn starts after the (empty) think block the generation prompt writes.
    scripted.start = tokenizer("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    trainer.train()

    assert calls == [(3, 4)] * 4  # parsed from the XML call, arguments cast to the declared integer types
    (record,) = recorder.calls
    first_turn, tool_result, answer = record["completions"][0]
    assert first_turn["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    ]
    assert tool_result == {"role": "tool", "name": "multiply", "content": "12"}
    assert answer["content"] == "It is 12."
    assert train_log(trainer)["tools/call_frequency"] == 1.0

"""Tests for trl.data_utils: format helpers, chat templates, prompt extraction, unpairing, packing, truncation."""

import copy
import json

import pytest
from datasets import Dataset, DatasetDict, IterableDataset
from transformers import AutoTokenizer

from trl.assets import get_tokenizer_path, load_test_dataset
from trl.data_utils import (
    apply_chat_template,
    common_prefix_length,
    detect_dataset_format,
    extract_prompt,
    get_dataset_column_names,
    is_conversational,
    is_conversational_from_value,
    maybe_apply_chat_template,
    maybe_convert_to_chatml,
    maybe_extract_prompt,
    maybe_unpair_preference_dataset,
    pack_dataset,
    prepare_multimodal_messages,
    truncate_dataset,
    unpair_preference_dataset,
    validate_dataset_format,
)


QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
LLAMA_BOS = "<|begin_of_text|>"


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def qwen():
    return AutoTokenizer.from_pretrained(get_tokenizer_path("qwen2_5"))


@pytest.fixture(scope="module")
def llama():
    return AutoTokenizer.from_pretrained(get_tokenizer_path("llama3"))


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}


# ---------------------------------------------------------------------------------------------------------------------
# is_conversational / is_conversational_from_value / maybe_convert_to_chatml
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "example",
    [
        {"messages": [user("Hi"), assistant("Yo")]},
        {"prompt": [user("Hi")]},
        {"prompt": [user("Hi")], "completion": [assistant("Yo")]},
        {"prompt": [user("Hi")], "chosen": [assistant("A")], "rejected": [assistant("B")]},
        {"chosen": [user("Hi"), assistant("A")], "rejected": [user("Hi"), assistant("B")]},
        {"prompt": [user("Hi")], "completion": [assistant("Yo")], "label": True},
    ],
)
def test_is_conversational_true(example):
    assert is_conversational(example) is True


@pytest.mark.parametrize(
    "example",
    [
        {"text": "The sky is blue."},
        {"prompt": "The sky is"},
        {"prompt": "The sky is", "completion": " blue."},
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"prompt": "What is 1+1?", "completions": ["1+1=2"], "labels": [True]},
        {"messages": []},
        {"input_ids": [1, 2, 3]},
        {"conversations": [{"from": "user", "value": "Hi"}]},
    ],
)
def test_is_conversational_false(example):
    assert is_conversational(example) is False


def test_is_conversational_from_value():
    assert is_conversational_from_value({"conversations": [{"from": "user", "value": "Hi"}]}) is True
    assert is_conversational_from_value({"conversations": [{"role": "user", "content": "Hi"}]}) is False
    assert is_conversational_from_value({"messages": [{"from": "user", "value": "Hi"}]}) is False
    assert is_conversational_from_value({"conversations": []}) is False
    assert is_conversational_from_value({"text": "Hi"}) is False


def test_maybe_convert_to_chatml_conversations():
    example = {"conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "yo"}]}
    assert maybe_convert_to_chatml(example) == {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }


def test_maybe_convert_to_chatml_other_keys_and_noop():
    example = {
        "prompt": [{"from": "user", "value": "hi"}],
        "completion": [{"from": "assistant", "value": "yo"}],
        "extra": 3,
    }
    assert maybe_convert_to_chatml(example) == {
        "prompt": [{"role": "user", "content": "hi"}],
        "completion": [{"role": "assistant", "content": "yo"}],
        "extra": 3,
    }
    chatml = {"messages": [user("hi")]}
    assert maybe_convert_to_chatml(copy.deepcopy(chatml)) == chatml
    standard = {"prompt": "hi", "completion": "yo"}
    assert maybe_convert_to_chatml(dict(standard)) == standard


def test_maybe_convert_to_chatml_dataset_map():
    dataset = Dataset.from_dict({"conversations": [[{"from": "user", "value": "hi"}, {"from": "gpt", "value": "yo"}]]})
    converted = dataset.map(maybe_convert_to_chatml, remove_columns="conversations")
    assert converted.column_names == ["messages"]
    assert converted[0]["messages"] == [{"role": "user", "content": "hi"}, {"role": "gpt", "content": "yo"}]


# ---------------------------------------------------------------------------------------------------------------------
# apply_chat_template / maybe_apply_chat_template
# ---------------------------------------------------------------------------------------------------------------------


def test_apply_chat_template_messages_qwen(qwen):
    output = apply_chat_template({"messages": [user("2+2?"), assistant("4")]}, qwen)
    assert output == {"text": QWEN_SYSTEM + "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"}


def test_apply_chat_template_messages_llama(llama):
    output = apply_chat_template({"messages": [user("2+2?"), assistant("4")]}, llama)
    expected = (
        LLAMA_BOS + "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
    )
    assert output == {"text": expected}


def test_apply_chat_template_prompt_only(qwen, llama):
    assert apply_chat_template({"prompt": [user("2+2?")]}, qwen) == {
        "prompt": QWEN_SYSTEM + "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    }
    assert apply_chat_template({"prompt": [user("2+2?")]}, llama) == {
        "prompt": LLAMA_BOS + "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    }


def test_apply_chat_template_prompt_ending_with_assistant_is_continued(qwen):
    output = apply_chat_template({"prompt": [user("2+2?"), assistant("The answer is")]}, qwen)
    assert output == {"prompt": QWEN_SYSTEM + "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\nThe answer is"}


def test_apply_chat_template_prompt_ending_with_tool_gets_generation_prompt(qwen):
    prompt = [user("2+2?"), {"role": "tool", "content": "4"}]
    output = apply_chat_template({"prompt": prompt}, qwen)
    expected = QWEN_SYSTEM + (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert output == {"prompt": expected}


def test_apply_chat_template_prompt_completion_qwen(qwen):
    example = {"prompt": [user("2+2?")], "completion": [assistant("4")]}
    output = apply_chat_template(example, qwen)
    assert output == {
        "prompt": QWEN_SYSTEM + "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
        "completion": "4<|im_end|>\n",
    }
    # The split lies exactly at the end of the generation prompt.
    full = apply_chat_template({"messages": example["prompt"] + example["completion"]}, qwen)["text"]
    assert output["prompt"] + output["completion"] == full
    assert output["prompt"] == apply_chat_template({"prompt": example["prompt"]}, qwen)["prompt"]


def test_apply_chat_template_prompt_completion_llama(llama):
    example = {"prompt": [{"role": "system", "content": "Be brief."}, user("2+2?")], "completion": [assistant("4")]}
    output = apply_chat_template(example, llama)
    assert output == {
        "prompt": LLAMA_BOS + "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "completion": "4<|eot_id|>",
    }


def test_apply_chat_template_preference(qwen, llama):
    example = {"prompt": [user("Sky?")], "chosen": [assistant("Blue")], "rejected": [assistant("Green")]}
    assert apply_chat_template(example, qwen) == {
        "prompt": QWEN_SYSTEM + "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\n",
        "chosen": "Blue<|im_end|>\n",
        "rejected": "Green<|im_end|>\n",
    }
    assert apply_chat_template(example, llama) == {
        "prompt": LLAMA_BOS + "<|start_header_id|>user<|end_header_id|>\n\nSky?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "chosen": "Blue<|eot_id|>",
        "rejected": "Green<|eot_id|>",
    }


def test_apply_chat_template_implicit_preference(qwen):
    example = {"chosen": [user("Sky?"), assistant("Blue")], "rejected": [user("Sky?"), assistant("Green")]}
    turn = QWEN_SYSTEM + "<|im_start|>user\nSky?<|im_end|>\n<|im_start|>assistant\n"
    assert apply_chat_template(example, qwen) == {
        "chosen": turn + "Blue<|im_end|>\n",
        "rejected": turn + "Green<|im_end|>\n",
    }


def test_apply_chat_template_unpaired_preference_keeps_label(llama):
    example = {"prompt": [user("Sky?")], "completion": [assistant("Green")], "label": False}
    assert apply_chat_template(example, llama) == {
        "prompt": LLAMA_BOS + "<|start_header_id|>user<|end_header_id|>\n\nSky?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "completion": "Green<|eot_id|>",
        "label": False,
    }


def test_apply_chat_template_ignores_extra_keys(qwen):
    example = {"prompt": [user("Hi")], "completion": [assistant("Yo")], "images": None, "id": 7}
    assert apply_chat_template(example, qwen) == {
        "prompt": QWEN_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "completion": "Yo<|im_end|>\n",
    }


QWEN_TOOLS_SYSTEM = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\nYou are provided with function signatures "
    "within <tools></tools> XML tags:\n<tools>\n" + json.dumps(ADD_TOOL) + "\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


@pytest.mark.parametrize("source", ["argument", "column_list", "column_json"])
def test_apply_chat_template_tools_qwen(qwen, source):
    example = {"prompt": [user("Hi")], "completion": [assistant("Yo")]}
    kwargs = {}
    if source == "argument":
        kwargs["tools"] = [ADD_TOOL]
    elif source == "column_list":
        example["tools"] = [ADD_TOOL]
    else:
        example["tools"] = json.dumps([ADD_TOOL])
    output = apply_chat_template(example, qwen, **kwargs)
    assert output == {
        "prompt": QWEN_TOOLS_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "completion": "Yo<|im_end|>\n",
    }


def test_apply_chat_template_tools_llama(llama):
    example = {"prompt": [user("Hi")], "completion": [assistant("Yo")], "tools": json.dumps([ADD_TOOL])}
    output = apply_chat_template(example, llama)
    assert output == {
        "prompt": LLAMA_BOS + "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\nYou have access "
        'to the following functions. To call a function, reply with a JSON object of the form {"name": function name, '
        '"parameters": dictionary of argument name and its value}.\n\n' + json.dumps(ADD_TOOL) + "\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "completion": "Yo<|eot_id|>",
    }


def test_apply_chat_template_per_example_tools_override_argument(qwen):
    other_tool = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
    example = {"prompt": [user("Hi")], "tools": [ADD_TOOL]}
    output = apply_chat_template(example, qwen, tools=[other_tool])
    assert '"name": "add"' in output["prompt"] and '"name": "other"' not in output["prompt"]
    # A null per-row value (rows without tools in an Arrow column) falls back to the argument.
    output = apply_chat_template({"prompt": [user("Hi")], "tools": None}, qwen, tools=[other_tool])
    assert '"name": "other"' in output["prompt"]


def test_apply_chat_template_tool_dataset(qwen):
    dataset = load_test_dataset("conversational_language_modeling_tools", split="train").select(range(4))
    rendered = dataset.map(apply_chat_template, fn_kwargs={"processing_class": qwen}, remove_columns=["messages"])
    for row, text in zip(dataset, rendered["text"], strict=True):
        first = row["messages"][0]
        system = first["content"] if first["role"] == "system" else QWEN_SYSTEM.split("\n")[1].split("<|im_end|>")[0]
        assert text.startswith(f"<|im_start|>system\n{system}\n\n# Tools")
        for tool in row["tools"]:
            assert f'"name": "{tool["function"]["name"]}"' in text
        assert text.endswith(row["messages"][-1]["content"] + "<|im_end|>\n")
        assert '<tool_call>\n{"name": "' in text


KWARGS_TEMPLATE = (
    "{%- for message in messages -%}<{{ message.role }}>{{ message.content }}</{{ message.role }}>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<assistant>{%- if enable_thinking is defined and not enable_thinking -%}"
    "<think></think>{%- endif -%}{%- endif -%}"
)


@pytest.fixture
def kwargs_tokenizer(qwen):
    tokenizer = copy.deepcopy(qwen)
    tokenizer.chat_template = KWARGS_TEMPLATE
    return tokenizer


def test_apply_chat_template_chat_template_kwargs(kwargs_tokenizer):
    # Without the kwarg: plain generation prompt.
    assert apply_chat_template({"prompt": [user("Hi")]}, kwargs_tokenizer) == {"prompt": "<user>Hi</user><assistant>"}
    # Per-example `chat_template_kwargs` reach the template.
    example = {"prompt": [user("Hi")], "chat_template_kwargs": {"enable_thinking": False}}
    assert apply_chat_template(example, kwargs_tokenizer) == {"prompt": "<user>Hi</user><assistant><think></think>"}
    # So do keyword arguments of the call.
    output = apply_chat_template({"prompt": [user("Hi")]}, kwargs_tokenizer, enable_thinking=False)
    assert output == {"prompt": "<user>Hi</user><assistant><think></think>"}
    # Null entries (Arrow fills missing struct fields with None) are ignored.
    example = {"prompt": [user("Hi")], "chat_template_kwargs": {"enable_thinking": None}}
    assert apply_chat_template(example, kwargs_tokenizer) == {"prompt": "<user>Hi</user><assistant>"}


def test_apply_chat_template_prompt_cut_back_to_common_prefix(kwargs_tokenizer):
    # With enable_thinking=False the generation prompt adds "<think></think>", which the rendering of the full
    # conversation does not contain: the prompt is cut back so that the completion starts where both agree.
    example = {
        "prompt": [user("Hi")],
        "completion": [assistant("Yo")],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    output = apply_chat_template(example, kwargs_tokenizer)
    assert output == {"prompt": "<user>Hi</user><assistant>", "completion": "Yo</assistant>"}
    example = {"prompt": [user("Hi")], "chosen": [assistant("A")], "rejected": [assistant("B")]}
    assert apply_chat_template(example, kwargs_tokenizer) == {
        "prompt": "<user>Hi</user><assistant>",
        "chosen": "A</assistant>",
        "rejected": "B</assistant>",
    }


def test_apply_chat_template_on_test_datasets(qwen):
    for config in [
        "conversational_language_modeling",
        "conversational_prompt_only",
        "conversational_prompt_completion",
        "conversational_preference",
        "conversational_implicit_prompt_preference",
        "conversational_unpaired_preference",
    ]:
        dataset = load_test_dataset(config, split="test").select(range(3))
        rendered = dataset.map(apply_chat_template, fn_kwargs={"processing_class": qwen})
        for row, out in zip(dataset, rendered, strict=True):
            if "messages" in row:
                assert out["text"] == qwen.apply_chat_template(row["messages"], tokenize=False)
            for key in ("completion", "chosen", "rejected"):
                if "prompt" in row and key in row:
                    full = qwen.apply_chat_template(row["prompt"] + row[key], tokenize=False)
                    assert out["prompt"] + out[key] == full
                    assert out["prompt"].endswith("<|im_start|>assistant\n")
            if "label" in row:
                assert out["label"] == row["label"]


@pytest.mark.parametrize(
    "example",
    [
        {"prompt": [user("Hi")], "completion": [assistant("Yo")], "chosen": [assistant("A")]},
        {"completion": [assistant("Yo")]},
        {"messages": [user("Hi")], "prompt": [user("Hi")]},
        {"chosen": [user("Hi")]},
        {"prompt": [user("Hi")], "label": True},
    ],
)
def test_apply_chat_template_invalid_keys(qwen, example):
    with pytest.raises(KeyError, match="Invalid keys in the example"):
        apply_chat_template(example, qwen)


def test_apply_chat_template_unknown_role(qwen):
    example = {"messages": [user("Hi"), {"role": "robot", "content": "Yo"}]}
    with pytest.raises(ValueError, match=r"role 'robot'.*\['system', 'developer', 'user', 'assistant', 'tool'\]"):
        apply_chat_template(example, qwen)


def test_apply_chat_template_prompt_ending_with_system(qwen):
    with pytest.raises(ValueError, match="last message of the prompt has role 'system'"):
        apply_chat_template({"prompt": [{"role": "system", "content": "Be nice."}]}, qwen)


def test_apply_chat_template_standard_example_raises(qwen):
    with pytest.raises(ValueError, match="must be a list of messages"):
        apply_chat_template({"prompt": "Hi", "completion": "Yo"}, qwen)


def test_apply_chat_template_without_chat_template(qwen):
    tokenizer = copy.deepcopy(qwen)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template") as error:
        apply_chat_template({"messages": [user("Hi")]}, tokenizer)
    message = str(error.value)
    assert "chat_template_path" in message and "clone_chat_template" in message
    assert "tokenizer.chat_template" in message


def test_apply_chat_template_bad_tools_string(qwen):
    with pytest.raises(ValueError, match="not valid JSON"):
        apply_chat_template({"prompt": [user("Hi")], "tools": "{not json"}, qwen)


def test_maybe_apply_chat_template(qwen):
    standard = {"prompt": "The sky is", "completion": " blue."}
    assert maybe_apply_chat_template(standard, qwen) is standard
    # A standard example works even with a tokenizer lacking a chat template.
    no_template = copy.deepcopy(qwen)
    no_template.chat_template = None
    assert maybe_apply_chat_template({"text": "abc"}, no_template) == {"text": "abc"}
    conversational = {"prompt": [user("2+2?")], "completion": [assistant("4")]}
    assert maybe_apply_chat_template(conversational, qwen) == {
        "prompt": QWEN_SYSTEM + "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
        "completion": "4<|im_end|>\n",
    }


# ---------------------------------------------------------------------------------------------------------------------
# extract_prompt / maybe_extract_prompt
# ---------------------------------------------------------------------------------------------------------------------


def test_extract_prompt_standard():
    assert extract_prompt({"chosen": "Sky is blue.", "rejected": "Sky is green."}) == {
        "prompt": "Sky is",
        "chosen": " blue.",
        "rejected": " green.",
    }
    # No space at the split point: the prompt ends right before the first difference.
    assert extract_prompt({"chosen": "2+2=4", "rejected": "2+2=5"}) == {
        "prompt": "2+2=",
        "chosen": "4",
        "rejected": "5",
    }
    # Nothing shared.
    assert extract_prompt({"chosen": "A", "rejected": "B"}) == {"prompt": "", "chosen": "A", "rejected": "B"}


def test_extract_prompt_conversational():
    example = {"chosen": [user("hi"), assistant("A")], "rejected": [user("hi"), assistant("B")]}
    assert extract_prompt(example) == {
        "prompt": [user("hi")],
        "chosen": [assistant("A")],
        "rejected": [assistant("B")],
    }
    system = {"role": "system", "content": "S"}
    example = {"chosen": [system, user("hi"), assistant("A")], "rejected": [system, user("ho"), assistant("A")]}
    assert extract_prompt(example) == {
        "prompt": [system],
        "chosen": [user("hi"), assistant("A")],
        "rejected": [user("ho"), assistant("A")],
    }


def test_maybe_extract_prompt():
    implicit = {"chosen": "Sky is blue.", "rejected": "Sky is green."}
    assert maybe_extract_prompt(implicit) == {"prompt": "Sky is", "chosen": " blue.", "rejected": " green."}
    explicit = {"prompt": "Sky is", "chosen": " blue.", "rejected": " green."}
    assert maybe_extract_prompt(explicit) is explicit
    conversational = {"prompt": [user("hi")], "chosen": [assistant("A")], "rejected": [assistant("B")]}
    assert maybe_extract_prompt(conversational) is conversational
    other = {"prompt": "x", "completion": "y"}
    assert maybe_extract_prompt(other) is other
    # A standard prompt next to conversational answers: the prompt is re-extracted from the answers.
    mixed = {"prompt": "hi", "chosen": [user("hi"), assistant("A")], "rejected": [user("hi"), assistant("B")]}
    assert maybe_extract_prompt(mixed) == {
        "prompt": [user("hi")],
        "chosen": [assistant("A")],
        "rejected": [assistant("B")],
    }


def test_maybe_extract_prompt_on_dataset():
    dataset = load_test_dataset("conversational_implicit_prompt_preference", split="test")
    extracted = dataset.map(maybe_extract_prompt)
    assert set(extracted.column_names) == {"prompt", "chosen", "rejected"}
    for row, out in zip(dataset, extracted, strict=True):
        assert out["prompt"] + out["chosen"] == row["chosen"]
        assert out["prompt"] + out["rejected"] == row["rejected"]
        assert out["prompt"][-1]["role"] == "user"


# ---------------------------------------------------------------------------------------------------------------------
# unpair_preference_dataset / maybe_unpair_preference_dataset
# ---------------------------------------------------------------------------------------------------------------------


def test_unpair_preference_dataset():
    dataset = Dataset.from_dict({"prompt": ["Sky is"], "chosen": [" blue"], "rejected": [" green"], "x": [1]})
    assert unpair_preference_dataset(dataset)[:] == {
        "prompt": ["Sky is", "Sky is"],
        "x": [1, 1],
        "completion": [" blue", " green"],
        "label": [True, False],
    }


def test_unpair_preference_dataset_batch_order_and_map_kwargs():
    dataset = Dataset.from_dict(
        {"prompt": ["p1", "p2", "p3"], "chosen": ["c1", "c2", "c3"], "rejected": ["r1", "r2", "r3"]}
    )
    unpaired = unpair_preference_dataset(dataset, batch_size=2, desc="Unpairing")
    assert unpaired[:] == {
        "prompt": ["p1", "p2", "p1", "p2", "p3", "p3"],
        "completion": ["c1", "c2", "r1", "r2", "c3", "r3"],
        "label": [True, True, False, False, True, False],
    }


def test_unpair_preference_dataset_implicit_prompt():
    dataset = Dataset.from_dict({"chosen": ["Sky is blue"], "rejected": ["Sky is green"]})
    assert unpair_preference_dataset(dataset)[:] == {
        "completion": ["Sky is blue", "Sky is green"],
        "label": [True, False],
    }


def test_unpair_preference_dataset_dict_and_iterable():
    dataset = Dataset.from_dict({"prompt": ["a", "b"], "chosen": ["c", "d"], "rejected": ["e", "f"]})
    unpaired = unpair_preference_dataset(DatasetDict({"train": dataset, "test": dataset}))
    assert unpaired["test"][:] == {
        "prompt": ["a", "b", "a", "b"],
        "completion": ["c", "d", "e", "f"],
        "label": [True, True, False, False],
    }
    iterable = unpair_preference_dataset(dataset.to_iterable_dataset(), num_proc=None, desc="ignored")
    assert isinstance(iterable, IterableDataset)
    assert list(iterable) == [
        {"prompt": "a", "completion": "c", "label": True},
        {"prompt": "b", "completion": "d", "label": True},
        {"prompt": "a", "completion": "e", "label": False},
        {"prompt": "b", "completion": "f", "label": False},
    ]


def test_unpair_conversational_test_dataset():
    dataset = load_test_dataset("conversational_preference", split="test")
    unpaired = unpair_preference_dataset(dataset)
    assert len(unpaired) == 2 * len(dataset)
    assert unpaired.column_names == ["prompt", "completion", "label"]
    assert unpaired[0]["completion"] == dataset[0]["chosen"]
    assert unpaired[len(dataset)]["completion"] == dataset[0]["rejected"]
    assert unpaired[len(dataset)]["prompt"] == dataset[0]["prompt"]


def test_maybe_unpair_preference_dataset():
    paired = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    assert maybe_unpair_preference_dataset(paired, num_proc=1, desc="Unpair")[:] == {
        "prompt": ["a", "a"],
        "completion": ["b", "c"],
        "label": [True, False],
    }
    unpaired = Dataset.from_dict({"prompt": ["a"], "completion": ["b"], "label": [True]})
    assert maybe_unpair_preference_dataset(unpaired) is unpaired
    iterable = paired.to_iterable_dataset()
    assert list(maybe_unpair_preference_dataset(iterable)) == [
        {"prompt": "a", "completion": "b", "label": True},
        {"prompt": "a", "completion": "c", "label": False},
    ]
    dataset_dict = DatasetDict({"train": paired})
    assert maybe_unpair_preference_dataset(dataset_dict)["train"].column_names == ["prompt", "completion", "label"]


# ---------------------------------------------------------------------------------------------------------------------
# pack_dataset / truncate_dataset
# ---------------------------------------------------------------------------------------------------------------------

EXAMPLES = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]}


def test_pack_bfd():
    packed = pack_dataset(Dataset.from_dict(EXAMPLES), 4, "bfd")
    assert packed[:] == {"input_ids": [[6, 7, 8, 9], [1, 2, 3, 10], [4, 5]], "seq_lengths": [[4], [3, 1], [2]]}


def test_pack_wrapped():
    packed = pack_dataset(Dataset.from_dict(EXAMPLES), 4, "wrapped")
    assert packed[:] == {"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]}


def test_pack_bfd_truncates_and_bfd_split_splits():
    dataset = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5, 6]]})
    assert pack_dataset(dataset, 4, "bfd")[:] == {"input_ids": [[1, 2, 3, 4]], "seq_lengths": [[4]]}
    assert pack_dataset(dataset, 4, "bfd_split")[:] == {"input_ids": [[1, 2, 3, 4], [5, 6]], "seq_lengths": [[4], [2]]}


def test_pack_bfd_split_fills_holes_with_chunks():
    dataset = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5, 6, 7], [8, 9]]})
    # Chunks: [1..4] (4), [5,6,7] (3), [8,9] (2) -> [1..4], [5,6,7], [8,9]: nothing fits after 3+2 > 4.
    assert pack_dataset(dataset, 4, "bfd_split")[:] == {
        "input_ids": [[1, 2, 3, 4], [5, 6, 7], [8, 9]],
        "seq_lengths": [[4], [3], [2]],
    }
    assert pack_dataset(dataset, 5, "bfd_split")[:] == {
        "input_ids": [[1, 2, 3, 4, 5], [6, 7, 8, 9]],
        "seq_lengths": [[5], [2, 2]],
    }


def test_pack_bfd_best_fit_choice():
    # Best fit puts the 2-token row into the bin with 2 free slots, not the one with 3.
    dataset = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13]]})
    assert pack_dataset(dataset, 8, "bfd")[:] == {
        "input_ids": [[6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 5]],
        "seq_lengths": [[6, 2], [5]],
    }


def test_pack_drops_empty_rows_and_keeps_aux_columns_aligned():
    dataset = Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3], [], [4, 5], [6, 7, 8, 9], [10]],
            "completion_mask": [[0, 1, 1], [], [0, 1], [0, 0, 1, 1], [1]],
            "assistant_masks": [[1, 1, 1], [], [0, 0], [1, 0, 1, 0], [0]],
        }
    )
    assert pack_dataset(dataset, 4, "bfd")[:] == {
        "input_ids": [[6, 7, 8, 9], [1, 2, 3, 10], [4, 5]],
        "completion_mask": [[0, 0, 1, 1], [0, 1, 1, 1], [0, 1]],
        "assistant_masks": [[1, 0, 1, 0], [1, 1, 1, 0], [0, 0]],
        "seq_lengths": [[4], [3, 1], [2]],
    }
    assert pack_dataset(dataset, 4, "wrapped")[:] == {
        "input_ids": [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]],
        "completion_mask": [[0, 1, 1, 0], [1, 0, 0, 1], [1, 1]],
        "assistant_masks": [[1, 1, 1, 0], [0, 1, 0, 1], [0, 0]],
    }


def test_pack_all_empty():
    packed = pack_dataset(Dataset.from_dict({"input_ids": [[], []]}), 4, "bfd")
    assert packed[:] == {"input_ids": [], "seq_lengths": []}


def test_pack_packs_within_map_batches():
    dataset = Dataset.from_dict({"input_ids": [[1], [2], [3], [4]]})
    packed = pack_dataset(dataset, 4, "bfd", map_kwargs={"batch_size": 2})
    assert packed[:] == {"input_ids": [[1, 2], [3, 4]], "seq_lengths": [[1, 1], [1, 1]]}
    packed = pack_dataset(dataset, 3, "wrapped", map_kwargs={"batch_size": 2, "desc": "Packing"})
    assert packed[:] == {"input_ids": [[1, 2], [3, 4]]}


def test_pack_keeps_format():
    dataset = Dataset.from_dict(EXAMPLES).with_format("torch")
    packed = pack_dataset(dataset, 4, "bfd")
    assert packed.format["type"] == "torch"
    assert packed.format["columns"] == ["input_ids", "seq_lengths"]
    assert packed[1]["input_ids"].tolist() == [1, 2, 3, 10]
    assert packed[1]["seq_lengths"].tolist() == [3, 1]
    wrapped = pack_dataset(Dataset.from_dict(EXAMPLES).with_format("numpy"), 4, "wrapped")
    assert wrapped.format["type"] == "numpy"
    assert wrapped[0]["input_ids"].tolist() == [1, 2, 3, 4]


def test_pack_iterable_dataset():
    iterable = Dataset.from_dict(EXAMPLES).to_iterable_dataset()
    assert list(pack_dataset(iterable, 4, "bfd")) == [
        {"input_ids": [6, 7, 8, 9], "seq_lengths": [4]},
        {"input_ids": [1, 2, 3, 10], "seq_lengths": [3, 1]},
        {"input_ids": [4, 5], "seq_lengths": [2]},
    ]
    assert list(pack_dataset(iterable, 4, "wrapped")) == [
        {"input_ids": [1, 2, 3, 4]},
        {"input_ids": [5, 6, 7, 8]},
        {"input_ids": [9, 10]},
    ]
    torch_iterable = pack_dataset(iterable.with_format("torch"), 4, "bfd_split")
    assert next(iter(torch_iterable))["input_ids"].tolist() == [6, 7, 8, 9]


def test_pack_dataset_dict():
    dataset = DatasetDict({"train": Dataset.from_dict(EXAMPLES), "test": Dataset.from_dict({"input_ids": [[1], [2]]})})
    packed = pack_dataset(dataset, 4)
    assert packed["train"]["input_ids"] == [[6, 7, 8, 9], [1, 2, 3, 10], [4, 5]]
    assert packed["test"][:] == {"input_ids": [[1, 2]], "seq_lengths": [[1, 1]]}


def test_pack_invalid_inputs():
    dataset = Dataset.from_dict(EXAMPLES)
    with pytest.raises(
        ValueError, match=r"Invalid packing strategy 'ffd', must be one of \('bfd', 'bfd_split', 'wrapped'\)"
    ):
        pack_dataset(dataset, 4, "ffd")
    with pytest.raises(ValueError, match="positive integer"):
        pack_dataset(dataset, 0)
    with_text = Dataset.from_dict({"input_ids": [[1, 2]], "text": ["ab"]})
    with pytest.raises(ValueError, match=r"column 'text' has type string.*remove_columns"):
        pack_dataset(with_text, 4)
    misaligned = Dataset.from_dict({"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1, 1]]})
    with pytest.raises(ValueError, match="row 1 column 'input_ids' has 1 elements and column 'attention_mask' has 2"):
        pack_dataset(misaligned, 4)


def test_truncate_dataset():
    dataset = Dataset.from_dict(
        {"input_ids": [[1, 2, 3], [4, 5], []], "mask": [[1, 1, 0], [0, 1], []], "y": [0, 1, 2]}
    )
    assert truncate_dataset(dataset, 2)[:] == {
        "input_ids": [[1, 2], [4, 5], []],
        "mask": [[1, 1], [0, 1], []],
        "y": [0, 1, 2],
    }
    assert truncate_dataset(dataset, 0)["input_ids"] == [[], [], []]
    torch_dataset = truncate_dataset(dataset.with_format("torch", columns=["input_ids"]), 1, map_kwargs={"desc": "T"})
    assert torch_dataset.format["columns"] == ["input_ids"]
    assert torch_dataset[0]["input_ids"].tolist() == [1]
    assert list(truncate_dataset(dataset.to_iterable_dataset(), 1)) == [
        {"input_ids": [1], "mask": [1], "y": 0},
        {"input_ids": [4], "mask": [0], "y": 1},
        {"input_ids": [], "mask": [], "y": 2},
    ]
    with pytest.raises(ValueError, match="non-negative integer"):
        truncate_dataset(dataset, -1)


# ---------------------------------------------------------------------------------------------------------------------
# prepare_multimodal_messages
# ---------------------------------------------------------------------------------------------------------------------


def test_prepare_multimodal_messages():
    messages = [{"role": "system", "content": "S"}, user("What?"), assistant("Cat")]
    assert prepare_multimodal_messages(messages, images=["IMG"]) == [
        {"role": "system", "content": [{"type": "text", "text": "S"}]},
        {"role": "user", "content": [{"type": "image", "image": "IMG"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Cat"}]},
    ]
    # The input is left untouched.
    assert messages[1] == user("What?")


def test_prepare_multimodal_messages_several_images_and_turns():
    messages = [user("Compare"), assistant("Ok"), user("And?"), {"role": "tool", "content": "42"}]
    assert prepare_multimodal_messages(messages, images=["A", "B"]) == [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "A"},
                {"type": "image", "image": "B"},
                {"type": "text", "text": "Compare"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Ok"}]},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
        {"role": "tool", "content": [{"type": "text", "text": "42"}]},
    ]
    assert prepare_multimodal_messages([user("Hi")]) == [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]


def test_prepare_multimodal_messages_fills_existing_placeholders():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Nice"}]},
        {"role": "user", "content": [{"type": "image", "image": None}, {"type": "image", "image": "KEPT"}]},
    ]
    assert prepare_multimodal_messages(messages, images=["X", "Y"]) == [
        {"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "image", "image": "X"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Nice"}]},
        {"role": "user", "content": [{"type": "image", "image": "Y"}, {"type": "image", "image": "KEPT"}]},
    ]
    assert messages[0]["content"][1] == {"type": "image"}


def test_prepare_multimodal_messages_errors():
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\) to fill but 2 image\(s\)"):
        prepare_multimodal_messages([{"role": "user", "content": [{"type": "image"}]}], images=["A", "B"])
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) to fill but 1 image\(s\)"):
        prepare_multimodal_messages([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], ["A"])
    with pytest.raises(ValueError, match="role 'robot'"):
        prepare_multimodal_messages([{"role": "robot", "content": "Hi"}])


# ---------------------------------------------------------------------------------------------------------------------
# common_prefix_length / get_dataset_column_names
# ---------------------------------------------------------------------------------------------------------------------


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([7], [8]) == 0


def test_common_prefix_length_tokenized_prompt(qwen):
    prompt = [user("2+2?")]
    prompt_ids = qwen.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    full_ids = qwen.apply_chat_template(prompt + [assistant("4")], tokenize=True, return_dict=False)
    assert common_prefix_length(prompt_ids, full_ids) == len(prompt_ids)


def test_get_dataset_column_names():
    dataset = Dataset.from_dict({"prompt": ["a"], "completion": ["b"]})
    assert get_dataset_column_names(dataset) == ["prompt", "completion"]
    assert get_dataset_column_names(dataset.to_iterable_dataset()) == ["prompt", "completion"]
    mapped = dataset.to_iterable_dataset().map(lambda row: {"x": 1})
    assert get_dataset_column_names(mapped) == ["prompt", "completion", "x"]
    assert get_dataset_column_names(DatasetDict({"train": dataset})) == ["prompt", "completion"]


# ---------------------------------------------------------------------------------------------------------------------
# detect_dataset_format / validate_dataset_format
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        ("standard_language_modeling", "language_modeling"),
        ("standard_prompt_only", "prompt_only"),
        ("standard_prompt_completion", "prompt_completion"),
        ("standard_preference", "preference"),
        ("standard_implicit_prompt_preference", "implicit_preference"),
        ("standard_unpaired_preference", "unpaired_preference"),
        ("standard_stepwise_supervision", "stepwise_supervision"),
        ("conversational_language_modeling", "language_modeling"),
        ("conversational_prompt_only", "prompt_only"),
        ("conversational_prompt_completion", "prompt_completion"),
        ("conversational_preference", "preference"),
        ("conversational_implicit_prompt_preference", "implicit_preference"),
        ("conversational_unpaired_preference", "unpaired_preference"),
    ],
)
def test_detect_dataset_format_test_datasets(config, expected):
    dataset = load_test_dataset(config, split="test")
    assert detect_dataset_format(dataset.column_names) == expected
    assert detect_dataset_format(dataset[0]) == expected


def test_detect_dataset_format_other_cases():
    assert detect_dataset_format(["input_ids", "completion_mask"]) == "tokenized"
    assert detect_dataset_format(["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"]) == "tokenized"
    assert detect_dataset_format(["conversations"]) == "language_modeling"
    assert detect_dataset_format(["content"], text_field="content") == "language_modeling"
    assert detect_dataset_format(["prompt", "images"]) == "prompt_only"
    assert detect_dataset_format({"prompt": "a", "completion": "b", "id": 3}) == "prompt_completion"
    with pytest.raises(
        ValueError, match=r"Could not detect the dataset format from the columns \['answer', 'question'\]"
    ):
        detect_dataset_format(["question", "answer"])
    with pytest.raises(ValueError, match="list of column names"):
        detect_dataset_format("prompt")


def test_validate_dataset_format():
    dataset = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    assert validate_dataset_format(dataset, ["preference", "implicit_preference"], "DPOTrainer") == "preference"
    assert validate_dataset_format(dataset.to_iterable_dataset(), ["preference"], "DPOTrainer") == "preference"
    assert validate_dataset_format({"text": "x"}, ["language_modeling"], "SFTTrainer") == "language_modeling"
    assert (
        validate_dataset_format(["body"], ["language_modeling"], "SFTTrainer", text_field="body")
        == "language_modeling"
    )


def test_validate_dataset_format_errors():
    dataset = Dataset.from_dict({"question": ["a"], "answer": ["b"]})
    with pytest.raises(ValueError) as error:
        validate_dataset_format(dataset, ["language_modeling", "prompt_completion"], "SFTTrainer")
    message = str(error.value)
    assert message.startswith("SFTTrainer expects a dataset in one of these formats")
    assert "language_modeling: 'text' (standard) or 'messages' (conversational)" in message
    assert "prompt_completion: 'prompt', 'completion'" in message
    assert "['question', 'answer']" in message and "match no known format" in message
    assert "dataset_text_field" in message and "dataset.rename_column" in message

    paired = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    with pytest.raises(ValueError, match="looks like the 'preference' format.*unpair_preference_dataset"):
        validate_dataset_format(paired, ["unpaired_preference"], "KTOTrainer")
    with pytest.raises(ValueError, match="Unknown dataset format type"):
        validate_dataset_format(paired, ["pairwise"], "X")

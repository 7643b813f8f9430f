import copy
import itertools
import warnings
from pathlib import Path

import pytest
from trainer_utils import requires_response_parser
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl import chat_template_utils as ctu
from trl.assets import get_model_path, get_tokenizer_path
from trl.chat_template_utils import (
    add_response_schema,
    clone_chat_template,
    get_training_chat_template,
    has_generation_markers,
    is_chat_template_prefix_preserving,
    is_chat_template_stop_token_trained,
    parse_response,
    supports_tool_calling,
)


TEMPLATE_DIR = Path(ctu.__file__).parent / "chat_templates"
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ADD_TOOL_JSON = (
    '{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": '
    '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}'
)


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}],
    "system_multi_turn": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What colour is the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass?"},
        {"role": "assistant", "content": "Green."},
    ],
    "tools": [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("add", a=1, b=2)]},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "assistant", "content": "1 + 2 = 3."},
    ],
    "parallel_tools": [
        {"role": "user", "content": "Add 1 + 2 and 3 + 4."},
        {"role": "assistant", "content": "Sure.", "tool_calls": [_call("add", a=1, b=2), _call("add", a=3, b=4)]},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "assistant", "content": "3 and 7."},
    ],
}


@pytest.fixture
def qwen(qwen_tokenizer):
    # Tests below mutate tokenizers (templates, response schemas); keep the session fixture pristine.
    return copy.deepcopy(qwen_tokenizer)


@pytest.fixture
def llama(llama_tokenizer):
    return copy.deepcopy(llama_tokenizer)


def _render(tokenizer, messages, template=None, **kwargs):
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# Bundled templates
# ----------------------------------------------------------------------------------------------------------------------


class TestBundledTemplates:
    def test_module_strings_are_the_package_files(self):
        assert ctu.tiny_qwen2_5_chat_template == (TEMPLATE_DIR / "tiny_qwen2_5.jinja").read_text()
        assert ctu.tiny_qwen2_5_training_chat_template == (TEMPLATE_DIR / "tiny_qwen2_5_training.jinja").read_text()
        assert ctu.tiny_llama3_chat_template == (TEMPLATE_DIR / "tiny_llama3.jinja").read_text()
        assert ctu.tiny_llama3_training_chat_template == (TEMPLATE_DIR / "tiny_llama3_training.jinja").read_text()
        assert (TEMPLATE_DIR / "README.md").is_file()

    def test_qwen_plain_conversation(self, qwen):
        text = _render(qwen, CONVERSATIONS["single"])
        expected = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n2 + 2 = 4.<|im_end|>\n"
        assert text == QWEN_SYSTEM + expected
        prompt = _render(qwen, CONVERSATIONS["single"][:1], add_generation_prompt=True)
        assert prompt == QWEN_SYSTEM + "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"

    def test_qwen_system_prompt_replaces_default(self, qwen):
        text = _render(qwen, CONVERSATIONS["system_multi_turn"][:3])
        assert text == (
            "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat colour is the sky?<|im_end|>\n"
            "<|im_start|>assistant\nBlue.<|im_end|>\n"
        )

    def test_qwen_tools(self, qwen):
        text = _render(qwen, CONVERSATIONS["parallel_tools"], tools=[ADD_TOOL])
        assert text == (
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{ADD_TOOL_JSON}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\nAdd 1 + 2 and 3 + 4.<|im_end|>\n"
            '<|im_start|>assistant\nSure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n3 and 7.<|im_end|>\n"
        )

    def test_qwen_tool_call_without_content_and_string_arguments(self, qwen):
        messages = [
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 5}'}}],
            },
        ]
        text = _render(qwen, messages)
        assert text.endswith(
            '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 5}}\n</tool_call><|im_end|>\n'
        )

    def test_llama_plain_conversation(self, llama):
        text = _render(llama, CONVERSATIONS["system_multi_turn"][:3])
        assert text == (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat colour is the sky?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nBlue.<|eot_id|>"
        )
        prompt = _render(llama, CONVERSATIONS["single"][:1], add_generation_prompt=True)
        assert prompt == (
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )

    def test_llama_tools(self, llama):
        text = _render(llama, CONVERSATIONS["tools"], tools=[ADD_TOOL])
        assert text == (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n"
            "You have access to the following functions. To call a function, reply with a JSON object of the form "
            '{"name": function name, "parameters": dictionary of argument name and its value}.\n\n'
            f"{ADD_TOOL_JSON}\n\n<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is 1 + 2?<|eot_id|>"
            '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>'
            "<|start_header_id|>ipython<|end_header_id|>\n\n3<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n1 + 2 = 3.<|eot_id|>"
        )

    @pytest.mark.parametrize("family", ["qwen2_5", "llama3"])
    def test_continue_final_message(self, family, qwen, llama):
        tokenizer = qwen if family == "qwen2_5" else llama
        messages = [{"role": "user", "content": "Colour of snow?"}, {"role": "assistant", "content": "Snow is"}]
        text = _render(tokenizer, messages, continue_final_message=True)
        full = _render(tokenizer, messages)
        assert text.endswith("Snow is")
        assert full.startswith(text)
        assert full[len(text) :] == ("<|im_end|>\n" if family == "qwen2_5" else "<|eot_id|>")

    @pytest.mark.parametrize(
        "family, training", itertools.product(["qwen2_5", "llama3"], [False, True]), ids=lambda v: str(v)
    )
    @pytest.mark.parametrize("name", list(CONVERSATIONS))
    def test_generation_prompt_is_prefix(self, family, training, name, qwen, llama):
        tokenizer = qwen if family == "qwen2_5" else llama
        template = getattr(ctu, f"tiny_{family}{'_training' if training else ''}_chat_template")
        messages = CONVERSATIONS[name]
        tools = [ADD_TOOL] if "tools" in name else None
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = _render(tokenizer, messages[:k], template, tools=tools, add_generation_prompt=True)
            full = _render(tokenizer, messages[: k + 1], template, tools=tools)
            assert full.startswith(prompt)
            prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
            full_ids = tokenizer(full, add_special_tokens=False).input_ids
            assert full_ids[: len(prompt_ids)] == prompt_ids

    @pytest.mark.parametrize("family", ["qwen2_5", "llama3"])
    @pytest.mark.parametrize("name", list(CONVERSATIONS))
    def test_training_template_renders_the_same_text(self, family, name, qwen, llama):
        tokenizer = qwen if family == "qwen2_5" else llama
        tools = [ADD_TOOL] if "tools" in name else None
        plain = _render(tokenizer, CONVERSATIONS[name], getattr(ctu, f"tiny_{family}_chat_template"), tools=tools)
        training = _render(
            tokenizer, CONVERSATIONS[name], getattr(ctu, f"tiny_{family}_training_chat_template"), tools=tools
        )
        assert plain == training

    @pytest.mark.parametrize(
        "family, expected",
        [
            (
                "qwen2_5",
                [
                    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
                    "1 + 2 = 3.<|im_end|>",
                ],
            ),
            ("llama3", ['{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>', "1 + 2 = 3.<|eot_id|>"]),
        ],
    )
    def test_assistant_mask_covers_content_and_end_token(self, family, expected, qwen, llama):
        tokenizer = qwen if family == "qwen2_5" else llama
        out = tokenizer.apply_chat_template(
            CONVERSATIONS["tools"],
            tools=[ADD_TOOL],
            chat_template=getattr(ctu, f"tiny_{family}_training_chat_template"),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids, mask = out["input_ids"], out["assistant_masks"]
        spans, current = [], []
        for token_id, flag in zip(ids, mask):
            if flag:
                current.append(token_id)
            elif current:
                spans.append(current)
                current = []
        if current:
            spans.append(current)
        assert [tokenizer.decode(span) for span in spans] == expected
        assert mask[-1] == (1 if family == "llama3" else 0)  # qwen ends with the "\n" after <|im_end|>


# ----------------------------------------------------------------------------------------------------------------------
# chat_template_utils functions
# ----------------------------------------------------------------------------------------------------------------------

NO_TOOLS_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MARKED_NO_TOOLS_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}assistant: {% generation %}{{ m.content }}<|im_end|>"
    "{% endgeneration %}\n{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# Supports tools, has markers, but appends a closing line only when the conversation is not waiting for a reply,
# so a conversation rendered without the generation prompt is no prefix of its continuation.
MARKED_NOT_PREFIX_PRESERVING = (
    "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
    "<|im_end|>{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}assistant: {% else %}<|endoftext|>{% endif %}"
)


class TestHasGenerationMarkers:
    @pytest.mark.parametrize(
        "template, expected",
        [
            ("{% generation %}x{% endgeneration %}", True),
            ("{%- generation -%}x{%- endgeneration -%}", True),
            ("{%generation%}x{%endgeneration%}", True),
            ("{{ messages }}", False),
            ("generation", False),
            ({"default": "{% generation %}x{% endgeneration %}", "tool_use": "x"}, True),
            ({"default": "x", "tool_use": "{% generation %}x{% endgeneration %}"}, False),
            ({"tool_use": "{% generation %}x{% endgeneration %}"}, False),
        ],
    )
    def test_values(self, template, expected):
        assert has_generation_markers(template) is expected

    def test_bundled(self):
        assert has_generation_markers(ctu.tiny_qwen2_5_chat_template) is False
        assert has_generation_markers(ctu.tiny_qwen2_5_training_chat_template) is True
        assert has_generation_markers(ctu.tiny_llama3_chat_template) is False
        assert has_generation_markers(ctu.tiny_llama3_training_chat_template) is True


class TestGetTrainingChatTemplate:
    def test_plain_templates_map_to_training_variants(self, qwen, llama):
        assert get_training_chat_template(qwen) == ctu.tiny_qwen2_5_training_chat_template
        assert get_training_chat_template(llama) == ctu.tiny_llama3_training_chat_template

    def test_recognition_ignores_surrounding_whitespace(self, qwen):
        qwen.chat_template = "\n" + ctu.tiny_qwen2_5_chat_template + "\n\n"
        assert get_training_chat_template(qwen) == ctu.tiny_qwen2_5_training_chat_template

    def test_training_templates_need_nothing(self, qwen, llama):
        qwen.chat_template = ctu.tiny_qwen2_5_training_chat_template
        llama.chat_template = ctu.tiny_llama3_training_chat_template
        assert get_training_chat_template(qwen) is None
        assert get_training_chat_template(llama) is None

    def test_markers_without_tool_support(self, qwen):
        qwen.chat_template = MARKED_NO_TOOLS_TEMPLATE
        assert get_training_chat_template(processing_class=qwen) is None

    def test_markers_but_not_prefix_preserving_is_rejected(self, qwen):
        qwen.chat_template = MARKED_NOT_PREFIX_PRESERVING
        assert supports_tool_calling(qwen) is True
        assert is_chat_template_prefix_preserving(qwen) is False
        with pytest.raises(ValueError, match="Qwen2.5, Qwen3"):
            get_training_chat_template(qwen)

    def test_unknown_template(self, qwen):
        qwen.chat_template = NO_TOOLS_TEMPLATE
        with pytest.raises(ValueError) as error:
            get_training_chat_template(qwen)
        message = str(error.value)
        assert "TRL has training variants for: Qwen2.5, Qwen3" in message
        assert "chat_template_path" in message

    def test_missing_template(self, qwen):
        qwen.chat_template = None
        with pytest.raises(ValueError, match="needs a chat template"):
            get_training_chat_template(qwen)

    def test_deprecated_tokenizer_argument(self, qwen):
        with pytest.warns(FutureWarning, match="processing_class"):
            assert get_training_chat_template(tokenizer=qwen) == ctu.tiny_qwen2_5_training_chat_template
        with pytest.raises(TypeError):
            get_training_chat_template(qwen, tokenizer=qwen)
        with pytest.raises(TypeError):
            get_training_chat_template()


class TestSupportsToolCalling:
    def test_bundled(self, qwen, llama):
        for tokenizer, training in (
            (qwen, ctu.tiny_qwen2_5_training_chat_template),
            (llama, ctu.tiny_llama3_training_chat_template),
        ):
            assert supports_tool_calling(tokenizer) is True
            tokenizer.chat_template = training
            assert supports_tool_calling(tokenizer) is True

    def test_template_ignoring_tools(self, qwen):
        qwen.chat_template = NO_TOOLS_TEMPLATE
        assert supports_tool_calling(qwen) is False

    def test_no_template(self, qwen):
        qwen.chat_template = None
        assert supports_tool_calling(qwen) is False

    def test_failing_template(self, qwen):
        qwen.chat_template = "{{ raise_exception('no tools here') }}"
        assert supports_tool_calling(qwen) is False


class TestPrefixPreserving:
    def test_bundled(self, qwen, llama):
        assert is_chat_template_prefix_preserving(qwen) is True
        assert is_chat_template_prefix_preserving(llama) is True
        qwen.chat_template = ctu.tiny_qwen2_5_training_chat_template
        assert is_chat_template_prefix_preserving(qwen) is True

    def test_not_preserving(self, qwen):
        qwen.chat_template = MARKED_NOT_PREFIX_PRESERVING
        assert is_chat_template_prefix_preserving(qwen) is False

    def test_missing_template(self, qwen):
        qwen.chat_template = None
        with pytest.raises(ValueError, match="chat template"):
            is_chat_template_prefix_preserving(qwen)


class TestStopTokenTrained:
    def test_plain_templates_have_no_mask(self, qwen, llama):
        assert is_chat_template_stop_token_trained(qwen) is False
        assert is_chat_template_stop_token_trained(llama) is False

    def test_training_templates(self, qwen, llama):
        assert is_chat_template_stop_token_trained(qwen, ctu.tiny_qwen2_5_training_chat_template) is True
        assert is_chat_template_stop_token_trained(llama, ctu.tiny_llama3_training_chat_template) is True
        llama.chat_template = ctu.tiny_llama3_training_chat_template
        assert is_chat_template_stop_token_trained(llama) is True

    def test_end_token_outside_the_mask(self, qwen):
        template = ctu.tiny_qwen2_5_training_chat_template.replace(
            "{{- '<|im_end|>' -}}\n        {%- endgeneration -%}",
            "{%- endgeneration -%}\n        {{- '<|im_end|>' -}}",
        )
        assert template != ctu.tiny_qwen2_5_training_chat_template
        assert _render(qwen, CONVERSATIONS["single"], template) == _render(qwen, CONVERSATIONS["single"])
        assert is_chat_template_stop_token_trained(qwen, template) is False

    def test_trailing_whitespace_in_mask_is_skipped(self, qwen):
        template = MARKED_NO_TOOLS_TEMPLATE.replace("<|im_end|>{% endgeneration %}", "<|im_end|>\n{% endgeneration %}")
        assert is_chat_template_stop_token_trained(qwen, template) is True


@requires_response_parser
class TestResponseSchema:
    def test_sets_response_template(self, qwen, llama):
        assert add_response_schema(qwen) is qwen
        assert qwen.response_template["start_anchor"] == "<|im_start|>assistant\n"
        assert add_response_schema(llama) is llama
        assert llama.response_template["start_anchor"] == "<|start_header_id|>assistant<|end_header_id|>\n\n"

    def test_training_template_is_recognised(self, qwen):
        qwen.chat_template = ctu.tiny_qwen2_5_training_chat_template
        add_response_schema(qwen)
        assert qwen.response_template["fields"]["tool_calls"]["close"] == "</tool_call>"

    def test_unknown_template(self, qwen):
        qwen.chat_template = NO_TOOLS_TEMPLATE
        with pytest.raises(ValueError, match="TRL has response schemas for: Qwen2.5"):
            add_response_schema(qwen)

    @pytest.mark.parametrize("family", ["qwen2_5", "llama3"])
    def test_round_trip_through_the_template(self, family, qwen, llama):
        # Rendering a tool-calling assistant turn and parsing its tokens gives the message back.
        tokenizer = add_response_schema(qwen if family == "qwen2_5" else llama)
        messages = CONVERSATIONS["parallel_tools"][:2]
        prompt = _render(tokenizer, messages[:1], add_generation_prompt=True)
        full = _render(tokenizer, messages)
        completion_ids = tokenizer(full[len(prompt) :], add_special_tokens=False).input_ids
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        parsed = parse_response(tokenizer, completion_ids, prefix=prompt_ids)
        assert parsed == {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [_call("add", a=1, b=2), _call("add", a=3, b=4)],
        }


@requires_response_parser
class TestParseResponse:
    def test_plain_text(self, qwen):
        add_response_schema(qwen)
        ids = qwen("The sky is blue.<|im_end|>", add_special_tokens=False).input_ids
        assert parse_response(qwen, ids, prefix=[]) == {"role": "assistant", "content": "The sky is blue."}

    def test_without_end_token(self, llama):
        add_response_schema(llama)
        ids = llama("Grass is green.", add_special_tokens=False).input_ids
        assert parse_response(llama, ids, prefix=[]) == {"role": "assistant", "content": "Grass is green."}

    def test_without_prefix_the_decoded_text_is_returned(self, qwen):
        # As in TRL: transformers needs the prompt to parse, so without one the plain decoded text comes back.
        add_response_schema(qwen)
        text = 'Hi.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
        ids = qwen(text + "<|im_end|>", add_special_tokens=False).input_ids
        assert parse_response(qwen, ids) == {"role": "assistant", "content": text}

    def test_tool_call_only(self, qwen):
        add_response_schema(qwen)
        text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
        ids = qwen(text, add_special_tokens=False).input_ids
        assert parse_response(qwen, ids, prefix=[]) == {
            "role": "assistant",
            "content": "",
            "tool_calls": [_call("add", a=1, b=2)],
        }

    def test_missing_arguments_become_empty_dict(self, qwen):
        add_response_schema(qwen)
        ids = qwen('<tool_call>\n{"name": "now"}\n</tool_call><|im_end|>', add_special_tokens=False).input_ids
        assert parse_response(qwen, ids, prefix=[])["tool_calls"] == [
            {"type": "function", "function": {"name": "now", "arguments": {}}}
        ]

    def test_tools_cast_arguments(self, llama):
        add_response_schema(llama)
        ids = llama('{"name": "add", "parameters": {"a": "1", "b": 2}}<|eot_id|>', add_special_tokens=False).input_ids
        assert parse_response(llama, ids, prefix=[], tools=[ADD_TOOL])["tool_calls"] == [_call("add", a=1, b=2)]
        assert parse_response(llama, ids, prefix=[])["tool_calls"] == [_call("add", a="1", b=2)]

    def test_invalid_tool_call_falls_back_to_text(self, qwen):
        add_response_schema(qwen)
        ids = qwen('Hi <tool_call>\n{"name": 3}\n</tool_call><|im_end|>', add_special_tokens=False).input_ids
        assert parse_response(qwen, ids, prefix=[]) == {
            "role": "assistant",
            "content": 'Hi <tool_call>\n{"name": 3}\n</tool_call>',
        }

    def test_no_schema_raises_attribute_error_with_the_fix(self, qwen):
        # As in TRL: a tokenizer without a response parser cannot parse (AttributeError), here with a hint.
        for name in ("response_template", "response_schema"):
            if getattr(qwen, name, None) is not None:
                setattr(qwen, name, None)
        ids = qwen("<|im_start|>Plain answer.<|im_end|>", add_special_tokens=False).input_ids
        with pytest.raises(AttributeError, match="add_response_schema"):
            parse_response(qwen, ids, prefix=[])


class TestCloneChatTemplate:
    @pytest.fixture
    def model_and_tokenizer(self):
        path = get_model_path("tiny-Qwen2ForCausalLM")
        return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)

    def test_clone_llama_template_onto_qwen(self, model_and_tokenizer):
        model, tokenizer = model_and_tokenizer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, tokenizer, added = clone_chat_template(model, tokenizer, get_tokenizer_path("llama3"))
        assert tokenizer.chat_template == ctu.tiny_llama3_chat_template
        # 16 llama special tokens are new; 4112 is rounded up to 4160 with 48 placeholders.
        assert len(tokenizer) == 4160
        assert model.get_input_embeddings().weight.shape[0] == 4160
        assert model.config.vocab_size == 4160
        assert added == list(range(4096, 4160))
        assert tokenizer.convert_ids_to_tokens([4096, 4105, 4111, 4112, 4159]) == [
            "<|begin_of_text|>",
            "<|eot_id|>",
            "<|reserved_special_token_7|>",
            "<extra_id_0>",
            "<extra_id_47>",
        ]
        assert tokenizer.eos_token == "<|eot_id|>"
        assert model.config.eos_token_id == model.generation_config.eos_token_id == 4105
        # Existing tokens keep their ids.
        assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 4091
        assert tokenizer.added_tokens_decoder[4105].special is True

    def test_no_rounding(self, model_and_tokenizer):
        model, tokenizer = model_and_tokenizer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, tokenizer, added = clone_chat_template(
                model, tokenizer, get_tokenizer_path("llama3"), resize_to_multiple_of=None
            )
        assert len(tokenizer) == model.get_input_embeddings().weight.shape[0] == 4112
        assert added == list(range(4096, 4112))

    def test_same_family_adds_nothing(self, model_and_tokenizer):
        model, tokenizer = model_and_tokenizer
        tokenizer.chat_template = None
        model, tokenizer, added = clone_chat_template(model, tokenizer, get_tokenizer_path("qwen2_5"))
        assert added == []
        assert len(tokenizer) == 4096
        assert tokenizer.chat_template == ctu.tiny_qwen2_5_chat_template
        assert model.config.eos_token_id == 4091

    def test_source_without_template(self, model_and_tokenizer, tmp_path):
        model, tokenizer = model_and_tokenizer
        source = AutoTokenizer.from_pretrained(get_tokenizer_path("llama3"))
        source.chat_template = None
        source.save_pretrained(tmp_path)
        (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
        with pytest.raises(ValueError, match="has no chat template to clone"):
            clone_chat_template(model, tokenizer, str(tmp_path))

    def test_cloning_twice_keeps_sizes_consistent(self, model_and_tokenizer):
        model, tokenizer = model_and_tokenizer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, tokenizer, _ = clone_chat_template(model, tokenizer, get_tokenizer_path("llama3"))
            tokenizer.add_tokens(["<new_token>"])  # 4161 tokens: the next clone pads to 4224
            model, tokenizer, added = clone_chat_template(model, tokenizer, get_tokenizer_path("llama3"))
        assert len(tokenizer) == model.get_input_embeddings().weight.shape[0] == 4224
        assert added == list(range(4161, 4224))
        assert tokenizer.convert_ids_to_tokens([4161, 4223]) == ["<extra_id_48>", "<extra_id_110>"]


def test_parse_response_accepts_tensors(qwen_tokenizer):
    import torch

    tokenizer = add_response_schema(copy.deepcopy(qwen_tokenizer))
    ids = torch.tensor(tokenizer("Blue.<|im_end|>", add_special_tokens=False).input_ids)
    prefix = torch.tensor(tokenizer("<|im_start|>assistant\n", add_special_tokens=False).input_ids)
    assert parse_response(tokenizer, ids, prefix=prefix) == {"role": "assistant", "content": "Blue."}

"""TRL's training chat templates against the model vendors' published templates.

The originals are not part of this project: they are read at test time from an installed source, the package data of
the real `trl==1.16.0` of the parity environment (`$PARITY_VENV`, else `.venv-parity/` in the checkout), and the
tests skip when it is absent. For every family the training variant must render the text the original renders, and
its generation blocks must cover the assistant turns and nothing else.
"""

import copy
import glob
import os
from pathlib import Path

import pytest
from chat_template_conversations import CONVERSATIONS
from trainer_utils import requires_response_parser
from transformers.utils.chat_template_utils import render_jinja_template

from trl import chat_template_utils as ctu
from trl._chat.families import FAMILIES, FAMILIES_BY_NAME
from trl._chat.recognition import identify_family


def _vendor_dir():
    roots = [os.environ.get("PARITY_VENV"), str(Path(__file__).resolve().parent.parent / ".venv-parity")]
    for root in filter(None, roots):
        found = glob.glob(os.path.join(root, "lib", "python*", "site-packages", "trl", "chat_templates"))
        if found:
            return Path(found[0])
    return None


VENDOR_DIR = _vendor_dir()


@pytest.fixture
def qwen(qwen_tokenizer):
    return copy.deepcopy(qwen_tokenizer)  # the session fixture stays pristine


@pytest.fixture
def llama(llama_tokenizer):
    return copy.deepcopy(llama_tokenizer)


needs_originals = pytest.mark.skipif(
    VENDOR_DIR is None, reason="the vendors' original templates come from the parity venv's trl package, not installed"
)
TRAINED = [family.name for family in FAMILIES if family.has_training]
SPECIALS = {"bos_token": "<BOS>", "eos_token": "<EOS>"}

# Where a training variant deliberately renders differently from the original (TRL's choices).
AFTER_EARLIER_TURN = {"multi_turn", "prompt_after_turn", "reasoning"}
DELIBERATE_DIFFERENCES = {
    # Every assistant turn keeps its think block (the original drops it before the last user query), which makes
    # conversations prefix-preserving.
    "qwen3": AFTER_EARLIER_TURN
    | {"tools", "tools_str_args", "two_calls", "two_calls_str_args", "tools_prompt", "text_parts", "image_parts"},
    "qwen3_5_think": AFTER_EARLIER_TURN,
    "qwen3_5_nothink": AFTER_EARLIER_TURN,
    "qwen3_6": AFTER_EARLIER_TURN,
    # Tool-call arguments are serialised with tojson (the original only takes JSON strings).
    "deepseekv3": {"tools", "tools_str_args", "two_calls", "two_calls_str_args", "tools_prompt"},
    # The reasoning of an answer is kept (the original drops the "<think>...</think>" part).
    "deepseek_r1_distill": {"think_inline"},
    # A tool result is rendered as a bare "<|START_OF_TURN_TOKEN|>" (the original adds "<|END_OF_TURN_TOKEN|>").
    "cohere2": {"tools_prompt"},
    # Each assistant turn ends with GLM's stop token (the next role token, "<|user|>" after the last turn).
    "glm4moe": {name for name, (messages, _) in CONVERSATIONS.items() if messages[-1]["role"] == "assistant"}
    - {"tools_str_args", "two_calls_str_args"},  # (both fail on JSON-string arguments)
}
# The vendors' file names of the originals each family covers.
ORIGINALS = {name: [name] for name in TRAINED}


def _original(name):
    return (VENDOR_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def _render(template, name):
    messages, kwargs = CONVERSATIONS[name]
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    try:
        texts, spans = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=template,
            return_assistant_tokens_mask=True,
            date_string="26 Jul 2024",
            **SPECIALS,
            **kwargs,
        )
    except Exception as error:
        return None, type(error).__name__
    return texts[0], spans[0]


def _texts(content):
    if isinstance(content, str):
        return [content.split("</think>")[-1].strip()] if content.strip() else []
    return [part["text"] for part in content or [] if part.get("type") == "text"]


@needs_originals
@pytest.mark.parametrize("family", TRAINED)
def test_training_variant_renders_the_original_text(family):
    training = FAMILIES_BY_NAME[family].training_template
    differing = set()
    for name in CONVERSATIONS:
        original_text, _ = _render(_original(family), name)
        text, _ = _render(training, name)
        if original_text is None and text is None:
            continue
        if text != original_text:
            differing.add(name)
    assert differing == DELIBERATE_DIFFERENCES.get(family, set())


@pytest.mark.parametrize("family", TRAINED)
def test_generation_blocks_cover_the_assistant_turns(family):
    training = FAMILIES_BY_NAME[family].training_template
    for name, (messages, _) in CONVERSATIONS.items():
        text, spans = _render(training, name)
        if text is None:
            continue
        inside = "".join(text[start:end] for start, end in spans)
        outside = "".join(text[end:start] for (_, end), (start, _) in zip([(0, 0), *spans], [*spans, (len(text), 0)]))
        for message in messages:
            for piece in _texts(message.get("content")):
                if piece not in text:  # templates that drop typed content parts
                    continue
                if message["role"] == "assistant":
                    assert piece in inside, (family, name, piece)
                elif message["role"] == "user":
                    assert piece not in inside, (family, name, piece)
                    assert piece in outside, (family, name, piece)
        if any(m["role"] == "assistant" for m in messages):
            assert spans, (family, name)


@needs_originals
@pytest.mark.parametrize("family", TRAINED)
def test_originals_are_recognised(family):
    for original in ORIGINALS[family]:
        assert identify_family(_original(original), SPECIALS) is FAMILIES_BY_NAME[family]


@needs_originals
def test_recognition_ignores_whitespace_and_the_date_string():
    qwen3 = _original("qwen3")
    # Whitespace that does not reach the output (inside tags, around the template) does not matter.
    reformatted = "\n" + qwen3.replace("{%- if", "{%-   if").replace("{{- '", "{{-  '") + "\n"
    assert identify_family(reformatted, SPECIALS).name == "qwen3"
    llama = _original("llama3_1")
    assert '"26 Jul 2024"' in llama
    assert identify_family(llama.replace('"26 Jul 2024"', '"01 Jan 2025"'), SPECIALS).name == "llama3_1"
    assert identify_family("{{ messages }}", SPECIALS) is None


@needs_originals
def test_get_training_chat_template_on_originals(qwen):
    for family in TRAINED:
        qwen.chat_template = _original(family)
        assert ctu.get_training_chat_template(qwen) == FAMILIES_BY_NAME[family].training_template
        qwen.chat_template = FAMILIES_BY_NAME[family].training_template
        assert ctu.get_training_chat_template(qwen) is None


@needs_originals
def test_families_without_training_variant_are_named(llama):
    llama.chat_template = _original("llama3_2")
    with pytest.raises(ValueError, match="Llama 3.1 / 3.2 template, for which TRL has no training variant"):
        ctu.get_training_chat_template(llama)
    assert ctu.add_response_schema(llama) is llama


@needs_originals
def test_json_string_argument_templates_support_tools(qwen):
    qwen.chat_template = _original("deepseekv3")
    assert ctu.supports_tool_calling(qwen) is True
    assert ctu.is_chat_template_prefix_preserving(qwen) is True


@pytest.mark.parametrize("family", TRAINED)
def test_module_strings(family):
    training = getattr(ctu, f"{family}_training_chat_template")
    plain = getattr(ctu, f"{family}_chat_template")
    assert ctu.has_generation_markers(training) and not ctu.has_generation_markers(plain)
    for name in CONVERSATIONS:
        assert _render(plain, name)[0] == _render(training, name)[0]


GEMMA4_ORIGINALS = ["gemma4", "gemma4_v2", "gemma4_v3", "gemma4_v4", "gemma4_v5"]


@needs_originals
@pytest.mark.parametrize("original", GEMMA4_ORIGINALS)
def test_gemma4_is_recognised_without_training_variant(qwen, original):
    qwen.chat_template = _original(original)
    assert identify_family(qwen.chat_template, SPECIALS) is FAMILIES_BY_NAME["gemma4"]
    with pytest.raises(ValueError, match="Gemma 4 template, for which TRL has no training variant"):
        ctu.get_training_chat_template(qwen)
    assert ctu.supports_tool_calling(qwen) is True
    assert ctu.is_chat_template_prefix_preserving(qwen) is True


WITHOUT_SCHEMA = ["muse_glimmer", "diffusion_gemma"]


@needs_originals
@pytest.mark.parametrize("original", WITHOUT_SCHEMA)
def test_tool_families_without_response_schema(qwen, original):
    # Training variant and tool calls, but TRL parses none of their completions.
    qwen.chat_template = _original(original)
    assert ctu.get_training_chat_template(qwen) == FAMILIES_BY_NAME[original].training_template
    assert ctu.supports_tool_calling(qwen) is True
    assert ctu.is_chat_template_prefix_preserving(qwen) is True
    assert ctu.is_chat_template_stop_token_trained(qwen) is False
    with pytest.raises(ValueError, match=f"there is none for {FAMILIES_BY_NAME[original].title} templates"):
        ctu.add_response_schema(qwen)


def test_muse_glimmer_masks_whole_assistant_messages():
    # Reasoning (to=self), each call (to=NAME) and the answer (to=user) are learned from their "<|start|>" header on.
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Look it up.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"days": 2}}}],
        },
        {"role": "tool", "content": "Sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    texts, spans = render_jinja_template(
        conversations=[messages],
        chat_template=FAMILIES_BY_NAME["muse_glimmer"].training_template,
        return_assistant_tokens_mask=True,
        current_date="2026-01-01",
    )
    text = texts[0]
    assert [text[start:end] for start, end in spans[0]] == [
        "<|start|>assistant to=self<|message|>Look it up.<|eom|><|start|>assistant to=get_weather<|message|>"
        '<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter name="days">2</atem:parameter>\n'
        "</atem:invoke>\n</atem:function_calls><|eot|>",
        "<|start|>assistant to=user<|message|>Sunny.<|eot|>",
    ]
    # A tool message without a name is named after the call's id, here absent.
    assert '<|start|>tool <|message|><tool_output name="">\nSunny\n</tool_output><|eot|>' in text


@needs_originals
def test_diffusion_gemma_and_gemma4_are_told_apart():
    # Same turns and call syntax, but the answer after a tool result opens a new model turn: the tool-result probe,
    # which Diffusion Gemma compares on top of the common ones, is what separates them.
    assert identify_family(_original("diffusion_gemma"), SPECIALS) is FAMILIES_BY_NAME["diffusion_gemma"]
    for original in GEMMA4_ORIGINALS:
        assert identify_family(_original(original), SPECIALS) is FAMILIES_BY_NAME["gemma4"]


def test_diffusion_gemma_masks_model_parts_only():
    # Thought, calls, text and the closing "<turn|>" are learned; the tool results written inside the model turn and
    # the "<|turn>model" headers are not.
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look.", "tool_calls": [call]},
        {"role": "tool", "name": "get_weather", "content": "Sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    texts, spans = render_jinja_template(
        conversations=[messages],
        chat_template=FAMILIES_BY_NAME["diffusion_gemma"].training_template,
        return_assistant_tokens_mask=True,
    )
    assert texts[0] == (
        "<|turn>user\nWeather?<turn|>\n<|turn>model\n<|channel>thought\nLook.\n<channel|>"
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>Sunny<|"|>}<tool_response|><|turn>model\nSunny.<turn|>\n'
    )
    assert [texts[0][start:end] for start, end in spans[0] if end > start] == [
        "<|channel>thought\nLook.\n<channel|>",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
        "Sunny.",
        "<turn|>\n",
    ]


@needs_originals
@requires_response_parser
def test_gemma4_response_parsing(qwen):
    qwen.chat_template = _original("gemma4_v5")
    ctu.add_response_schema(qwen)
    prompt = qwen.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)["input_ids"]

    def parse(text):
        return ctu.parse_response(qwen, qwen(text, add_special_tokens=False)["input_ids"], prefix=list(prompt))

    assert parse("<|channel>thought\nHm.\n<channel|>Hello!<turn|>") == {
        "role": "assistant",
        "reasoning_content": "Hm.",
        "content": "Hello!",
    }
    call = 'Sure.<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,days:3,opts:{hourly:true}}<tool_call|>'
    parsed = parse(call + "<|tool_response>")
    assert parsed["content"] == "Sure."
    assert parsed["tool_calls"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": {"city": 'Paris, "FR"', "days": 3, "opts": {"hourly": True}},
            },
        }
    ]

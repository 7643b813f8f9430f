"""The chat template families TRL knows: their training templates (package data `trl/chat_templates/*.jinja`,
written for TRL), how to recognise them and the response schema of those that emit tool calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from . import schemas


TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "chat_templates"


@cache
def load_template(filename: str) -> str:
    """Text of a bundled template file."""
    return (TEMPLATE_DIR / filename).read_text(encoding="utf-8")


@dataclass(frozen=True, eq=False)
class Family:
    """A chat template family.

    Args:
        name: Identifier, also the stem of the training template file (`<name>_training.jinja`).
        title: Human-readable name used in messages.
        markers: Literal strings every template of the family contains (a cheap filter before rendering).
        has_training: Whether TRL ships a training variant (`<name>_training.jinja`).
        schema: Response parsing schema for `add_response_schema`, or None.
        ignored_probes: Indices of recognition probes on which the training variant deliberately renders differently
            from the family's original template (so they cannot be used to recognise it).
        probe_aliases: Candidate probe index -> training-variant probe index to compare it with, where the variant
            renders an input the way the original renders another one.
        extra_probes: Probes past `recognition.COMPARED_PROBES` also compared with the training variant, where only
            they tell the family apart from another one.
        trailing_stops: Texts the training variant may append after a conversation's last assistant turn (stop
            tokens the original leaves out); ignored when comparing renderings.
        detect: For families without a training variant: a predicate on the probe renderings (None where a probe
            fails) telling whether a template belongs to the family.
    """

    name: str
    title: str
    markers: tuple[str, ...]
    has_training: bool = True
    schema: dict[str, Any] | None = None
    ignored_probes: tuple[int, ...] = field(default_factory=tuple)
    probe_aliases: dict[int, int] = field(default_factory=dict)
    extra_probes: tuple[int, ...] = ()
    trailing_stops: tuple[str, ...] = ()
    detect: Callable[[list[str | None]], bool] | None = None

    @property
    def training_template(self) -> str | None:
        return load_template(f"{self.name}_training.jinja") if self.has_training else None


def _is_llama3_1(renderings: list[str | None]) -> bool:
    # Llama 3.1 / 3.2 open every conversation with a system turn giving the knowledge cut-off and today's date, and
    # write tool calls as bare {"name": ..., "parameters": ...} objects.
    plain, _, _, tool_call, *_ = renderings
    return (
        plain is not None
        and "<|start_header_id|>system<|end_header_id|>" in plain
        and "Cutting Knowledge Date:" in plain
        and tool_call is not None
        and '"parameters": {"city": "Paris"' in tool_call
    )


def _is_lfm2_5(renderings: list[str | None]) -> bool:
    # LFM2.5 templates (which already carry generation markers) write calls as Python lists between
    # "<|tool_call_start|>" and "<|tool_call_end|>" in ChatML turns.
    tool_call = renderings[3]
    return tool_call is not None and "<|im_start|>assistant\n<|tool_call_start|>[get_weather(" in tool_call


def _is_gemma4(renderings: list[str | None]) -> bool:
    # Gemma 4 templates write turns as "<|turn>ROLE\n...<turn|>" and calls as "<|tool_call>call:NAME{key:...}"; the
    # answer after an inline tool response continues the model turn (Diffusion Gemma, which reads the same, opens a new
    # one).
    plain, tool_call, tool_result = renderings[0], renderings[3], renderings[9]
    return (
        plain is not None
        and "<|turn>user\nHi<turn|>\n<|turn>model\nHello<turn|>" in plain
        and tool_call is not None
        and "<|turn>model\n<|tool_call>call:get_weather{" in tool_call
        and tool_result is not None
        and "<tool_response|><|turn>model\n" not in tool_result
    )


# Recognition probe indices (see `recognition.PROBES`): 0 user/assistant, 1 with system, 2 generation prompt,
# 3 tool call with dict arguments, 4 tool call with JSON-string arguments, 5 text parts, 6 image + generation prompt,
# 7 empty system message, 8 reasoning content, 9 tool result then answer (read by `detect`, compared only for families
# listing it in `extra_probes`). Families that share probe renderings are told apart by markers in the template source
# (Nemotron 3 Super / Ultra read `low_effort` / `medium_effort`), so they come first.
FAMILIES: tuple[Family, ...] = (
    Family("qwen2_5", "Qwen2.5", ("<|im_start|>",), schema=schemas.CHATML_REASONING_SCHEMA),
    # The original drops the think block of turns before the last user query; the text-parts probe is such a case.
    Family("qwen3", "Qwen3", ("<|im_start|>", "<think>"), schema=schemas.CHATML_REASONING_SCHEMA, ignored_probes=(5,)),
    Family("qwen3_instruct_2507", "Qwen3-Instruct-2507", ("<|im_start|>",), schema=schemas.CHATML_REASONING_SCHEMA),
    Family("qwen3_5_think", "Qwen3.5 (thinking)", ("<|im_start|>", "<function="), schema=schemas.QWEN3_5_SCHEMA),
    Family("qwen3_5_nothink", "Qwen3.5 (no thinking)", ("<|im_start|>", "<function="), schema=schemas.QWEN3_5_SCHEMA),
    Family("qwen3_6", "Qwen3.6", ("<|im_start|>", "<function="), schema=schemas.QWEN3_5_SCHEMA),
    Family("qwen3_8", "Qwen3.8", ("<|im_start|>", "<function="), schema=schemas.QWEN3_5_SCHEMA),
    Family("qwen2_5_vl", "Qwen2.5-VL", ("<|im_start|>", "<|vision_start|>")),
    Family("qwen3_vl", "Qwen3-VL", ("<|im_start|>", "<|vision_start|>"), schema=schemas.CHATML_REASONING_SCHEMA),
    Family("llama3", "Llama 3", ("<|start_header_id|>",)),
    Family(
        "llama3_1",
        "Llama 3.1 / 3.2",
        ("<|start_header_id|>",),
        has_training=False,
        schema=schemas.LLAMA3_SCHEMA,
        detect=_is_llama3_1,
    ),
    Family("gptoss", "GPT-OSS", ("<|start|>", "<|channel|>"), schema=schemas.GPT_OSS_SCHEMA),
    # The training variant ends the last assistant turn with GLM's stop token, which the original omits.
    Family(
        "glm4moe",
        "GLM-4-MoE",
        ("[gMASK]<sop>",),
        schema=schemas.GLM4_MOE_SCHEMA,
        trailing_stops=("<|user|>", "<|observation|>"),
    ),
    Family("gemma", "Gemma", ("<start_of_turn>",)),
    Family("gemma3", "Gemma 3", ("<start_of_turn>",)),
    # Gemma 4's turns and calls, but the answer after a tool result opens a new model turn: only the tool-result probe
    # tells it apart from Gemma 4, so that probe is compared too.
    Family("diffusion_gemma", "Diffusion Gemma", ("<|turn>", "<|tool_call>"), extra_probes=(9,)),
    # ATEM protocol: harmony-like "<|start|>assistant to=NAME<|message|>" messages, calls in "<atem:function_calls>".
    Family("muse_glimmer", "Muse Glimmer", ("<|start|>", "<atem:function_calls>")),
    Family(
        "gemma4",
        "Gemma 4",
        ("<|turn>", "<|tool_call>"),
        has_training=False,
        schema=schemas.GEMMA4_SCHEMA,
        detect=_is_gemma4,
    ),
    Family("phi3", "Phi-3", ("<|assistant|>",)),
    Family("phi3_5", "Phi-3.5", ("<|assistant|>",)),
    # The original needs tool-call arguments as a JSON string and fails on dicts; the training variant serialises
    # dicts, so its dict-argument rendering is what the original renders for string arguments.
    Family(
        "deepseekv3",
        "DeepSeek-V3",
        ("<｜Assistant｜>", "tool▁calls▁begin"),
        ignored_probes=(3,),
        probe_aliases={4: 3},
    ),
    Family("cohere", "Cohere", ("<|START_OF_TURN_TOKEN|>",)),
    Family("lfm2", "LFM2", ("<|im_start|>",)),
    Family("lfm2_v2", "LFM2 (tool calls)", ("<|im_start|>", "<|tool_call_start|>"), schema=schemas.LFM2_SCHEMA),
    Family(
        "lfm2_5",
        "LFM2.5",
        ("<|im_start|>", "<|tool_call_start|>"),
        has_training=False,
        schema=schemas.LFM2_SCHEMA,
        detect=_is_lfm2_5,
    ),
    Family("cohere2", "Cohere 2", ("<|START_OF_TURN_TOKEN|>", "<|START_RESPONSE|>")),
    Family("idefics3", "Idefics3", ("<end_of_utterance>",)),
    Family("smolvlm", "SmolVLM", ("<end_of_utterance>",)),
    Family("llava_next", "LLaVA-NeXT", ("[INST]",)),
    Family("nemotron_3_super", "Nemotron 3 Super", ("<|im_start|>", "low_effort"), schema=schemas.NEMOTRON_3_SCHEMA),
    Family(
        "nemotron_3_ultra", "Nemotron 3 Ultra", ("<|im_start|>", "medium_effort"), schema=schemas.NEMOTRON_3_SCHEMA
    ),
    Family("nemotron_3_nano", "Nemotron 3 Nano", ("<|im_start|>", "<tool_call>"), schema=schemas.NEMOTRON_3_SCHEMA),
    Family(
        "nemotron_3_5_lightning",
        "Nemotron 3.5 Lightning",
        ("<|im_start|>", "<tool_call>"),
        schema=schemas.NEMOTRON_3_SCHEMA,
    ),
    Family("deepseek_r1_distill", "DeepSeek-R1-Distill", ("<｜Assistant｜>",), schema=schemas.DEEPSEEK_R1_SCHEMA),
)

# Templates of the offline test tokenizers (`trl.assets`): TRL's own ChatML and Llama-3-style templates, which render
# tool calls and string arguments their own way. Tried after the model families.
TINY_FAMILIES: tuple[Family, ...] = (
    Family("tiny_qwen2_5", "TRL's test ChatML (Qwen2.5 style)", ("<|im_start|>",), schema=schemas.CHATML_SCHEMA),
    Family("tiny_llama3", "TRL's test Llama 3 style", ("<|start_header_id|>",), schema=schemas.LLAMA3_SCHEMA),
)

ALL_FAMILIES: tuple[Family, ...] = FAMILIES + TINY_FAMILIES
FAMILIES_BY_NAME: dict[str, Family] = {family.name: family for family in ALL_FAMILIES}

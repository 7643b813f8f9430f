"""Offline vision-language assets: tiny random-weight VLMs with locally assembled processors, and image datasets.

Three layouts of how a model receives images are covered, one model each:

- `tiny-Qwen2VLForConditionalGeneration`: variable-size images cut into 14x14 patches, flattened into one
  `pixel_values` tensor of shape `(total_patches, channels * temporal * 14 * 14)` plus `image_grid_thw`.
- `tiny-LlavaForConditionalGeneration`: every image resized to one fixed size, `pixel_values` of shape
  `(num_images, 3, 28, 28)`.
- `tiny-Idefics3ForConditionalGeneration`: images split into tiles plus a global view, `pixel_values` of shape
  `(batch, max_tiles, 3, 28, 28)` with a `pixel_attention_mask`.

Each processor pairs a PIL-backed image processor (no torchvision needed) with a tokenizer derived from the offline
`qwen2_5` tokenizer plus the family's image tokens, and a chat template that places those tokens. Built and cached
through `trl.assets` (`get_model_path`, `load_test_dataset`).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from ._compat import pil_image_processor


_TEXT_DECODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 2048,
}

# Image tokens each family's tokenizer gets (special, added after the base vocabulary).
_IMAGE_TOKENS = {
    "tiny-Qwen2VLForConditionalGeneration": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "tiny-LlavaForConditionalGeneration": ["<image>"],
    "tiny-Idefics3ForConditionalGeneration": [
        "<fake_token_around_image>",
        "<image>",
        "<end_of_utterance>",
        "<global-img>",
    ]
    + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
}

_TEMPLATES = {
    "tiny-Qwen2VLForConditionalGeneration": "tiny_qwen2_vl.jinja",
    "tiny-LlavaForConditionalGeneration": "tiny_llava.jinja",
    "tiny-Idefics3ForConditionalGeneration": "tiny_idefics3.jinja",
}


def _tokenizer(name: str, base_tokenizer_dir: str):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    if name == "tiny-Qwen2VLForConditionalGeneration":
        tokenizer = _qwen2_tokenizer_class().from_pretrained(
            base_tokenizer_dir, extra_special_tokens={"image_token": "<|image_pad|>"}
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(base_tokenizer_dir)
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in _IMAGE_TOKENS[name]], special_tokens=True
    )
    if name == "tiny-Idefics3ForConditionalGeneration":
        tokenizer.eos_token = "<end_of_utterance>"
    return tokenizer


def _qwen2_tokenizer_class() -> type:
    """The tokenizer class the tiny Qwen2-VL processor accepts.

    Before 5.4 the processor is a Qwen2VLProcessor, whose constructor checks for a Qwen2 tokenizer class.
    """
    import transformers

    return (
        transformers.AutoTokenizer
        if hasattr(transformers, "PaddleOCRVLProcessor")
        else transformers.Qwen2TokenizerFast
    )


def _processor(name: str, tokenizer, template: str):
    if name == "tiny-Qwen2VLForConditionalGeneration":
        import transformers

        # 56x56 to 112x112 pixels: 4 to 16 patch groups of 2x2 patches, i.e. 4 to 16 image tokens per image.
        image_processor = pil_image_processor("qwen2_vl", "Qwen2VL")(min_pixels=56 * 56, max_pixels=112 * 112)
        if hasattr(transformers, "PaddleOCRVLProcessor"):
            # Qwen2VLProcessor requires a video processor, which needs torchvision; PaddleOCRVLProcessor (5.4+)
            # expands `<|image_pad|>` exactly as Qwen2VLProcessor does (one token per merged 2x2 patch group)
            # without one.
            return transformers.PaddleOCRVLProcessor(
                image_processor=image_processor, tokenizer=tokenizer, chat_template=template
            )
        return transformers.Qwen2VLProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=_qwen2_vl_video_processor(),
            chat_template=template,
        )
    if name == "tiny-LlavaForConditionalGeneration":
        from transformers import LlavaProcessor

        image_processor = pil_image_processor("llava", "Llava")(
            size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
        )
        return LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=template,
        )
    from transformers import Idefics3Processor

    # Images up to 56 pixels on their long side, split into 28x28 tiles (at most 2x2) plus a global 28x28 view.
    image_processor = pil_image_processor("idefics3", "Idefics3")(
        size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=True
    )
    return Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=template
    )


def _qwen2_vl_video_processor():
    """The Qwen2-VL video processor transformers < 5.4 requires in every Qwen2VLProcessor (it needs torchvision)."""
    try:
        import torchvision  # noqa: F401
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    except Exception as error:
        raise ImportError(
            "The tiny Qwen2-VL test processor needs torchvision on transformers < 5.4 (its Qwen2VLProcessor requires "
            f"a video processor): importing it failed with {error!r}. Install a torchvision build matching your "
            "torch, or upgrade with `pip install 'transformers>=5.4'`."
        ) from error
    return Qwen2VLVideoProcessor()


def _config(name: str, tokenizer):
    import transformers

    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    token = tokenizer.convert_tokens_to_ids
    if name == "tiny-Qwen2VLForConditionalGeneration":
        text = {**_TEXT_DECODER, **ids, "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6]}}
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
        return transformers.Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=token("<|image_pad|>"),
            video_token_id=token("<|video_pad|>"),
            vision_start_token_id=token("<|vision_start|>"),
            vision_end_token_id=token("<|vision_end|>"),
        )
    if name == "tiny-LlavaForConditionalGeneration":
        vision = {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "projection_dim": 32,
        }
        return transformers.LlavaConfig(
            text_config={"model_type": "llama", **_TEXT_DECODER, **ids, "head_dim": 32},
            vision_config=vision,
            image_token_index=token("<image>"),
            image_seq_length=4,
            vision_feature_layer=-1,
        )
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 7,
    }
    return transformers.Idefics3Config(
        text_config={"model_type": "llama", **_TEXT_DECODER, **ids, "head_dim": 32},
        vision_config=vision,
        image_token_id=token("<image>"),
        scale_factor=2,
    )


def build_vlm_model(name: str, out_dir: Path, base_tokenizer_dir: str, template: str) -> None:
    """Build one tiny VLM (seeded random weights) with its processor into `out_dir`."""
    import torch
    import transformers
    from transformers import GenerationConfig

    tokenizer = _tokenizer(name, base_tokenizer_dir)
    processor = _processor(name, tokenizer, template)
    config = _config(name, tokenizer)
    model_cls_name = name.removeprefix("tiny-")
    torch.manual_seed(zlib.crc32(name.encode()))
    model = getattr(transformers, model_cls_name)(config).eval()
    model.config.architectures = [model_cls_name]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    from trl.assets import save_model_quietly

    save_model_quietly(model, out_dir)
    processor.save_pretrained(str(out_dir))


def template_file(name: str) -> str:
    """File name (under `trl/chat_templates/`) of the chat template of a tiny VLM."""
    return _TEMPLATES[name]


# ---------------------------------------------------------------------------------------------------------------------
# Image datasets
# ---------------------------------------------------------------------------------------------------------------------

_SHAPES = ("square", "circle", "stripes", "cross")
_COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
# Image sizes vary so grid-based processors produce different patch counts per image.
_SIZES = ((56, 56), (84, 56), (56, 84), (64, 64), (40, 48))


def make_image(index: int):
    """A deterministic RGB image: a coloured shape on a grey background, its size cycling through `_SIZES`."""
    from PIL import Image, ImageDraw

    width, height = _SIZES[index % len(_SIZES)]
    colour_name = list(_COLOURS)[index % len(_COLOURS)]
    shape = _SHAPES[(index // len(_COLOURS)) % len(_SHAPES)]
    image = Image.new("RGB", (width, height), (128 + index % 64, 128, 128))
    draw = ImageDraw.Draw(image)
    box = (width // 5, height // 5, 4 * width // 5, 4 * height // 5)
    fill = _COLOURS[colour_name]
    if shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "stripes":
        for x in range(0, width, 6):
            draw.rectangle((x, 0, x + 2, height), fill=fill)
    else:
        draw.rectangle((width // 2 - 3, 0, width // 2 + 3, height), fill=fill)
        draw.rectangle((0, height // 2 - 3, width, height // 2 + 3), fill=fill)
    return image


def _description(index: int) -> tuple[str, str]:
    colour = list(_COLOURS)[index % len(_COLOURS)]
    shape = _SHAPES[(index // len(_COLOURS)) % len(_SHAPES)]
    wrong = list(_COLOURS)[(index + 2) % len(_COLOURS)]
    return f"A {colour} {shape}.", f"A {wrong} {shape}."


_QUESTIONS = ("What is in the image?", "Describe the image.", "What shape do you see?", "What colour is it?")


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def vision_rows(name: str, count: int = 24) -> list[dict[str, Any]]:
    """Rows of an image dataset (PIL images under `images`, or `image` for the standard prompt-only set)."""
    rows = []
    for i in range(count):
        answer, wrong = _description(i)
        question = _QUESTIONS[i % len(_QUESTIONS)]
        prompt = [_user(question)]
        images = [make_image(i)]
        if name == "vision_conversational_language_modeling":
            rows.append({"messages": prompt + [_assistant(answer)], "images": images})
        elif name == "vision_conversational_prompt_completion":
            rows.append({"prompt": prompt, "completion": [_assistant(answer)], "images": images})
        elif name == "vision_conversational_prompt_only":
            rows.append({"prompt": prompt, "images": images})
        elif name == "vision_conversational_preference":
            rows.append(
                {"prompt": prompt, "chosen": [_assistant(answer)], "rejected": [_assistant(wrong)], "images": images}
            )
        elif name == "vision_conversational_unpaired_preference":
            label = i % 3 != 1
            rows.append(
                {
                    "prompt": prompt,
                    "completion": [_assistant(answer if label else wrong)],
                    "label": label,
                    "images": images,
                }
            )
        elif name == "vision_standard_prompt_only":
            rows.append({"prompt": question, "image": images[0]})
        else:
            raise AssertionError(name)
    return rows


def build_vision_dataset(name: str, out_dir: Path) -> None:
    """Save the train (24 rows) and test (8 rows) splits of an image dataset with `datasets.Dataset.save_to_disk`."""
    from datasets import Dataset, DatasetDict

    rows = vision_rows(name, 32)
    DatasetDict({"train": Dataset.from_list(rows[:24]), "test": Dataset.from_list(rows[24:])}).save_to_disk(
        str(out_dir / "data")
    )

"""Vision-language helpers: regrouping flattened pixel values per sample, image-free copies of messages, and the
checks that tell a vision dataset, a processor and a tokenizer apart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def split_pixel_values_by_grid(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Group the flattened per-image pixel values of a batch by sample.

    Grid-based processors (Qwen2-VL family) return one `pixel_values` tensor holding the patches of every image of
    the batch back to back, and `image_grid_thw` with one `(t, h, w)` row per image (`t * h * w` patches each). With
    `num_images` (images per sample), `pixel_values` and `image_grid_thw` become lists with one tensor per sample.
    Tile-based processors that give `spatial_shapes` instead are split by `num_tiles` (tiles per sample); their
    `image_position_ids` are split the same way. Any other batch is returned unchanged (the same object).

    Args:
        batch (`dict[str, torch.Tensor]`):
            Batch with `pixel_values`, `num_images` and either `image_grid_thw` or `spatial_shapes`, `num_tiles` and
            `pixel_attention_mask`.

    Returns:
        `dict[str, torch.Tensor | list[torch.Tensor]]`: A new dict with the grouped entries, other entries as given.

    Raises:
        ValueError: If the patch counts of the grid do not add up to the rows of `pixel_values`, or the tile counts
            do not add up to the rows of the tiled tensors.
    """
    if "pixel_values" not in batch or "num_images" not in batch:
        return batch
    num_images = [int(n) for n in batch["num_images"]]
    pixel_values = batch["pixel_values"]
    if "image_grid_thw" in batch:
        grid = batch["image_grid_thw"]
        lengths = grid.prod(dim=-1).tolist()
        if sum(lengths) != pixel_values.size(0):
            raise ValueError(
                f"Mismatch: sum(lengths) = {sum(lengths)} != pixel_values.size(0) = {pixel_values.size(0)}: the "
                "image_grid_thw rows (t * h * w patches per image) must account for every row of pixel_values."
            )
        patch_counts = [sum(part) for part in _split_list(lengths, num_images)]
        return {
            **batch,
            "pixel_values": list(pixel_values.split(patch_counts, dim=0)),
            "image_grid_thw": list(grid.split(num_images, dim=0)),
        }
    if "spatial_shapes" in batch:
        num_tiles = [int(n) for n in batch["num_tiles"]]
        for key in ("spatial_shapes", "pixel_attention_mask", "pixel_values"):
            rows = batch[key].size(0)
            if rows != sum(num_tiles):
                raise ValueError(
                    f"`{key}` has {rows} rows but num_tiles={num_tiles} adds up to {sum(num_tiles)}: give one row per "
                    "tile, and the number of tiles of each sample in `num_tiles`."
                )
        split = {**batch, "pixel_values": list(pixel_values.split(num_tiles, dim=0))}
        if "image_position_ids" in batch:
            split["image_position_ids"] = list(batch["image_position_ids"].split(num_tiles, dim=0))
        return split
    return batch


def _split_list(values: list[int], sizes: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for size in sizes:
        out.append(values[start : start + size])
        start += size
    return out


def unsplit_pixel_values_by_grid(batch: dict[str, torch.Tensor | list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of [`split_pixel_values_by_grid`]: concatenate per-sample lists back into single tensors.

    `pixel_values`, `image_grid_thw` and `image_position_ids` given as lists are concatenated along the first
    dimension; a batch with none of them as a list is returned unchanged (the same object).

    Args:
        batch (`dict[str, torch.Tensor | list[torch.Tensor]]`):
            Batch as produced by [`split_pixel_values_by_grid`] (possibly after selecting or reordering samples).

    Returns:
        `dict[str, torch.Tensor]`: A new dict with concatenated tensors.
    """
    keys = [
        key for key in ("pixel_values", "image_grid_thw", "image_position_ids") if isinstance(batch.get(key), list)
    ]
    if not keys:
        return batch
    return {**batch, **{key: torch.cat(batch[key], dim=0) for key in keys}}


def strip_images_from_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy of `messages` in which every `{"type": "image", "image": ...}` part keeps only its placeholder.

    Useful to log or serialise conversations without the image objects. String contents are kept as they are.
    """
    stripped = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    part = {key: value for key, value in part.items() if key != "image"}
                parts.append(part)
            message = {**message, "content": parts}
        stripped.append(message)
    return stripped


def is_processor(processing_class: Any) -> bool:
    """True for a multimodal `ProcessorMixin` (a processor wrapping a tokenizer), False for a plain tokenizer."""
    from transformers import ProcessorMixin

    return isinstance(processing_class, ProcessorMixin)


def is_vision_example(example: dict[str, Any] | None) -> bool:
    """True when a dataset row carries images (an `image` or `images` column)."""
    return example is not None and ("image" in example or "images" in example)


def example_images(example: dict[str, Any]) -> list:
    """The images of a row as a list: `images` as given, `image` wrapped, nothing when neither is set."""
    if example.get("images") is not None:
        return list(example["images"])
    if example.get("image") is not None:
        return [example["image"]]
    return []


def has_image_placeholders(example: dict[str, Any] | None) -> bool:
    """True when a conversational row has `{"type": "image"}` content parts."""
    for value in (example or {}).values():
        if isinstance(value, list):
            for message in value:
                content = message.get("content") if isinstance(message, dict) else None
                if isinstance(content, list) and any(
                    isinstance(part, dict) and part.get("type") == "image" for part in content
                ):
                    return True
    return False


def check_image_columns(example: dict[str, Any] | None, trainer_name: str) -> None:
    """Image placeholders need images: fail clearly when a row has `{"type": "image"}` parts but no image column."""
    if not is_vision_example(example) and has_image_placeholders(example):
        raise ValueError(
            f"The dataset's messages contain {{'type': 'image'}} placeholders but the dataset has no 'images' (or "
            f"'image') column, so {trainer_name} has no image to put there. Add the images as an 'images' column (a "
            "list of PIL images per row), or remove the image placeholders for text-only training."
        )


def check_vision_processing_class(processing_class: Any, trainer_name: str) -> None:
    """Images need a processor: fail clearly when a vision dataset is paired with a text-only tokenizer."""
    if not is_processor(processing_class):
        raise ValueError(
            f"The dataset appears to be vision-related (contains 'image' or 'images' keys), but the provided "
            f"processing class ({type(processing_class).__name__}) is a text-only tokenizer, so {trainer_name} cannot "
            "turn the images into pixel values. Pass the model's processor (AutoProcessor.from_pretrained(<model>)) "
            "as processing_class, or remove the image columns for text-only training."
        )


def image_token_id(processor: Any) -> int | None:
    """Id of the token that stands for one image embedding (the token the processor repeats), if any."""
    token_id = getattr(processor, "image_token_id", None)
    if token_id is not None:
        return int(token_id)
    token = getattr(processor, "image_token", None)
    if token is None:
        return None
    return processor.tokenizer.convert_tokens_to_ids(token)


# Processor outputs a vision-language model's forward takes besides `input_ids` and `attention_mask`.
VISION_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "image_sizes",
    "mm_token_type_ids",
    "token_type_ids",
    "image_position_ids",
    "spatial_shapes",
)


def vision_forward_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The image entries of a collated batch, to pass to the model's forward next to the token tensors."""
    return {key: inputs[key] for key in VISION_INPUT_KEYS if key in inputs}


# Processor outputs with one value per prompt token (left-padded like the prompt ids).
_TOKEN_LEVEL_KEYS = ("mm_token_type_ids", "token_type_ids")


def vision_rows_from_batch(encoded: dict[str, Any], num_images: list[int]) -> list[dict[str, torch.Tensor]]:
    """Cut a processor's output (a left-padded batch of prompts with images) into one dict per row.

    Online trainers shuffle and split a rollout batch by rows, but grid-based processors flatten the patches of all
    images into one tensor: `split_pixel_values_by_grid` groups them per row first. Row-aligned tensors (fixed-size
    or tiled images, pixel masks) keep their row; per-image tensors are split by `num_images`; per-token extras keep
    the row's real (unpadded) prompt positions. [`collate_vision_rows`] puts rows back together.
    """
    mask = encoded["attention_mask"].bool()
    rows_count = mask.shape[0]
    grouped = split_pixel_values_by_grid({**encoded, "num_images": num_images})
    rows: list[dict[str, torch.Tensor]] = [{} for _ in range(rows_count)]
    total_images = sum(num_images)
    for key in VISION_INPUT_KEYS:
        if key not in grouped:
            continue
        value = grouped[key]
        if key in _TOKEN_LEVEL_KEYS:
            parts = [value[i][mask[i]] for i in range(rows_count)]
        elif isinstance(value, list):
            parts = value
        elif value.shape[0] == rows_count:
            parts = list(value.split(1, dim=0))
        elif value.shape[0] == total_images:
            parts = list(value.split(num_images, dim=0))
        else:
            raise ValueError(
                f"Cannot assign the processor output `{key}` (leading size {value.shape[0]}) to {rows_count} rows "
                f"with {total_images} images."
            )
        for row, part in zip(rows, parts):
            row[key] = part
    return rows


def collate_vision_rows(rows: list[dict[str, torch.Tensor]], prompt_width: int, total_width: int) -> dict:
    """Forward-pass image inputs of a micro-batch from the per-row dicts of [`vision_rows_from_batch`].

    Per-token extras are left-padded to the prompt width and extended with zeros over the completion positions.
    """
    out = {}
    for key in rows[0]:
        if key in _TOKEN_LEVEL_KEYS:
            padded = [
                torch.nn.functional.pad(row[key], (prompt_width - row[key].shape[0], total_width - prompt_width))
                for row in rows
            ]
            out[key] = torch.stack(padded)
        else:
            out[key] = torch.cat([row[key] for row in rows], dim=0)
    return out


def prompt_with_images(example: dict[str, Any]) -> Any:
    """A row's prompt with its images attached: conversational prompts get typed content and filled
    `{"type": "image"}` placeholders (see `prepare_multimodal_messages`); standard prompts are returned as given."""
    from ...data_utils import prepare_multimodal_messages

    prompt = example["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and "role" in prompt[0]:
        return prepare_multimodal_messages(prompt, example_images(example))
    return prompt

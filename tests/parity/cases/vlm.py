"""Parity cases: vision-language models (tiny Qwen2-VL-style grid model, LLaVA, Idefics3) in SFT, DPO and KTO, the
vision collators' batches, and the pixel-value regrouping helpers."""

from __future__ import annotations

import os

from . import COMMON_ARGS, expect_error, register, run_trainer, to_jsonable


QWEN_VL = "tiny-Qwen2VLForConditionalGeneration"
LLAVA = "tiny-LlavaForConditionalGeneration"
IDEFICS3 = "tiny-Idefics3ForConditionalGeneration"
VLM_ARGS = {**COMMON_ARGS, "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "max_steps": 2}


def vision_dataset(ctx, name: str, split: str, n: int):
    """An image dataset of the offline assets (saved with `save_to_disk`: PIL images do not fit in JSON lines)."""
    from datasets import load_from_disk

    dataset = load_from_disk(os.path.join(ctx.assets[f"datasets/{name}"], "data"))[split]
    return dataset.select(range(min(n, len(dataset))))


def vision_trainer_case(ctx, kind: str, dataset: str, model: str = QWEN_VL, **config) -> dict:
    import trl

    prefix = {"sft": "SFT", "dpo": "DPO", "kto": "KTO"}[kind]
    args = getattr(trl, f"{prefix}Config")(output_dir=ctx.tmpdir(), **{**VLM_ARGS, **config})
    trainer = getattr(trl, f"{prefix}Trainer")(
        model=ctx.model(model),
        args=args,
        train_dataset=vision_dataset(ctx, dataset, "train", 4),
        eval_dataset=vision_dataset(ctx, dataset, "test", 4),
    )
    out = run_trainer(trainer)
    out["collator"] = type(trainer.data_collator).__name__
    return out


for _model, _tag in ((QWEN_VL, "qwen2_vl"), (LLAVA, "llava"), (IDEFICS3, "idefics3")):
    register(
        f"vlm/sft_prompt_completion_{_tag}",
        lambda ctx, m=_model: vision_trainer_case(ctx, "sft", "vision_conversational_prompt_completion", m),
    )
register(
    "vlm/sft_messages",
    lambda ctx: vision_trainer_case(ctx, "sft", "vision_conversational_language_modeling"),
)
register(
    "vlm/sft_messages_assistant_only",
    lambda ctx: vision_trainer_case(
        ctx, "sft", "vision_conversational_language_modeling", LLAVA, assistant_only_loss=True
    ),
)
register(
    "vlm/sft_max_length",
    lambda ctx: vision_trainer_case(ctx, "sft", "vision_conversational_prompt_completion", max_length=45),
)
register("vlm/dpo_qwen2_vl", lambda ctx: vision_trainer_case(ctx, "dpo", "vision_conversational_preference"))
register("vlm/dpo_idefics3", lambda ctx: vision_trainer_case(ctx, "dpo", "vision_conversational_preference", IDEFICS3))
register(
    "vlm/kto_llava", lambda ctx: vision_trainer_case(ctx, "kto", "vision_conversational_unpaired_preference", LLAVA)
)


def online_vision_case(ctx, kind: str, model: str) -> dict:
    """GRPO / RLOO from image prompts: two steps, a reward reading the image and the completion's length."""
    import trl

    def image_reward(completions, images, **kwargs):
        return [
            sum(row[0].getpixel((0, 0))) / 765 + 0.01 * len(completion[0]["content"])
            for row, completion in zip(images, completions)
        ]

    prefix = {"grpo": "GRPO", "rloo": "RLOO"}[kind]
    args = getattr(trl, f"{prefix}Config")(
        output_dir=ctx.tmpdir(),
        **{**COMMON_ARGS, "max_steps": 2, "num_generations": 2, "max_completion_length": 6, "learning_rate": 1e-2},
    )
    trainer = getattr(trl, f"{prefix}Trainer")(
        model=ctx.model(model),
        reward_funcs=image_reward,
        args=args,
        train_dataset=vision_dataset(ctx, "vision_conversational_prompt_only", "train", 8),
    )
    out = run_trainer(trainer, evaluate=False)
    out["suppress_tokens"] = list(trainer.generation_config.suppress_tokens or [])
    return out


register("vlm/grpo_qwen2_vl", lambda ctx: online_vision_case(ctx, "grpo", QWEN_VL))
register("vlm/grpo_idefics3", lambda ctx: online_vision_case(ctx, "grpo", IDEFICS3))
register("vlm/rloo_llava", lambda ctx: online_vision_case(ctx, "rloo", LLAVA))


def collator_case(ctx, model: str) -> dict:
    """Batches of the three vision collators on three rows, in several configurations."""
    from transformers import AutoProcessor

    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference
    from trl.trainer.kto_trainer import DataCollatorForVisionUnpairedPreference
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    processor = AutoProcessor.from_pretrained(ctx.model(model))

    def rows(name):
        dataset = vision_dataset(ctx, name, "train", 3)
        return [dataset[i] for i in range(3)]

    # Row names, loaded afresh for each collator: TRL's collators fill the image placeholders of the rows in place.
    lm, pc = "vision_conversational_language_modeling", "vision_conversational_prompt_completion"
    pref, unpaired = "vision_conversational_preference", "vision_conversational_unpaired_preference"
    cases = {
        "lm": (DataCollatorForVisionLanguageModeling(processor), lm),
        "lm_assistant_only": (DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True), lm),
        "lm_completion_only": (DataCollatorForVisionLanguageModeling(processor, completion_only_loss=True), lm),
        "pc": (DataCollatorForVisionLanguageModeling(processor), pc),
        "pc_completion_only": (DataCollatorForVisionLanguageModeling(processor, completion_only_loss=True), pc),
        "pc_max_length": (DataCollatorForVisionLanguageModeling(processor, max_length=60), pc),
        "preference": (DataCollatorForVisionPreference(processor), pref),
        "preference_max_length": (DataCollatorForVisionPreference(processor, max_length=60), pref),
        "unpaired": (DataCollatorForVisionUnpairedPreference(processor), unpaired),
        "unpaired_no_kl": (DataCollatorForVisionUnpairedPreference(processor, calculate_kl=False), unpaired),
    }
    out = {}
    for key, (collator, batch_rows) in cases.items():
        out[key] = expect_error(lambda c=collator, r=rows(batch_rows): {k: to_jsonable(v) for k, v in c(r).items()})
    return out


for _model, _tag in ((QWEN_VL, "qwen2_vl"), (LLAVA, "llava"), (IDEFICS3, "idefics3")):
    register(f"vlm/collators_{_tag}", lambda ctx, m=_model: collator_case(ctx, m))


def split_pixel_values_case(ctx) -> dict:
    import torch

    from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

    grid = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 2, 2]])
    pixel_values = torch.arange(32, dtype=torch.float32).reshape(16, 2)
    batches = {
        "grid": {"pixel_values": pixel_values, "image_grid_thw": grid, "num_images": [2, 1]},
        "grid_empty_sample": {"pixel_values": pixel_values, "image_grid_thw": grid, "num_images": [3, 0]},
        "grid_positions": {
            "pixel_values": pixel_values,
            "image_grid_thw": grid,
            "num_images": [1, 2],
            "image_position_ids": torch.arange(32).reshape(16, 2),
        },
        "tiles": {
            "pixel_values": torch.arange(36, dtype=torch.float32).reshape(3, 6, 2),
            "spatial_shapes": torch.tensor([[1, 5], [2, 3], [1, 4]]),
            "num_tiles": [2, 1],
            "num_images": [2, 1],
            "pixel_attention_mask": torch.ones(3, 6),
            "image_position_ids": torch.arange(36).reshape(3, 6, 2),
        },
        "no_counts": {"pixel_values": pixel_values, "image_grid_thw": grid},
    }
    out = {}
    for key, batch in batches.items():
        split = split_pixel_values_by_grid(batch)
        out[key] = {"split": to_jsonable(split), "unsplit": to_jsonable(unsplit_pixel_values_by_grid(split))}
    out["mismatch"] = expect_error(
        lambda: split_pixel_values_by_grid(
            {"pixel_values": torch.zeros(20, 2), "image_grid_thw": grid, "num_images": [3]}
        )
    )
    return out


register("vlm/split_pixel_values", split_pixel_values_case)


def images_with_tokenizer_case(ctx) -> dict:
    from transformers import AutoTokenizer

    import trl

    def build():
        args = trl.SFTConfig(output_dir=ctx.tmpdir(), **VLM_ARGS)
        trl.SFTTrainer(
            model=ctx.model(QWEN_VL),
            args=args,
            train_dataset=vision_dataset(ctx, "vision_conversational_prompt_completion", "train", 4),
            processing_class=AutoTokenizer.from_pretrained(ctx.model(QWEN_VL)),
        )

    return expect_error(build)


register("vlm/error_images_with_tokenizer", images_with_tokenizer_case, phrases=("vision-related",))

"""Vision-language models in SFT, DPO and KTO, on the three offline VLM layouts (grid patches, fixed-size images,
image tiles)."""

import pytest
import torch
from datasets import Dataset
from trainer_utils import (
    PREFERENCE_ARGS,
    args_builder,
    assert_rewards_saw_group_images,
    assert_saved_model_reloads,
    changed_params,
    recording_image_reward,
    requires_qwen2_vl_processor,
    snapshot,
    train_and_check_metrics,
    vlm_layouts,
)
from transformers import AutoModelForImageTextToText, AutoProcessor

from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.trainer.dpo_trainer import DataCollatorForVisionPreference
from trl.trainer.kto_trainer import DataCollatorForVisionUnpairedPreference
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling


PIL = pytest.importorskip("PIL")
pytest.importorskip("PIL.Image")

LAYOUTS = vlm_layouts(
    "tiny-Qwen2VLForConditionalGeneration",
    "tiny-LlavaForConditionalGeneration",
    "tiny-Idefics3ForConditionalGeneration",
)
sft_args = args_builder(
    SFTConfig, max_steps=2, per_device_train_batch_size=2, per_device_eval_batch_size=2, learning_rate=1e-2
)
dpo_args = args_builder(DPOConfig, **PREFERENCE_ARGS)
kto_args = args_builder(KTOConfig, **PREFERENCE_ARGS)
SFT_METRICS = ["loss", "entropy", "mean_token_accuracy", "num_tokens"]


def _vision_tower(model):
    inner = getattr(model, "model", model)
    for name in ("visual", "vision_tower", "vision_model"):
        if hasattr(inner, name):
            return getattr(inner, name)
    raise AssertionError(f"no vision tower on {type(model).__name__}")


def _load(name):
    path = get_model_path(name)
    return AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)


@pytest.mark.parametrize("name", LAYOUTS)
def test_sft_trains_language_model_and_keeps_frozen_vision_tower(name, tmp_path):
    model, processor = _load(name)
    tower = _vision_tower(model)
    for p in tower.parameters():
        p.requires_grad_(False)
    tower_before = {n: p.detach().clone() for n, p in tower.named_parameters()}
    data = load_test_dataset("vision_conversational_prompt_completion")
    trainer = SFTTrainer(
        model=model,
        args=sft_args(tmp_path),
        train_dataset=data["train"],
        eval_dataset=data["test"],
        processing_class=processor,
    )
    assert isinstance(trainer.data_collator, DataCollatorForVisionLanguageModeling)
    before = snapshot(trainer.model)
    train_and_check_metrics(trainer, SFT_METRICS)
    changed = changed_params(before, trainer.model)
    assert any("lm_head" in n or "language_model" in n or "text_model" in n for n in changed), changed
    for n, p in tower.named_parameters():
        assert torch.equal(p, tower_before[n]), n


@pytest.mark.parametrize("name", LAYOUTS)
def test_completion_only_labels_mask_exactly_image_and_prompt_tokens(name):
    processor = AutoProcessor.from_pretrained(get_model_path(name))
    rows = [load_test_dataset("vision_conversational_prompt_completion", "train")[i] for i in range(3)]
    batch = DataCollatorForVisionLanguageModeling(processor, completion_only_loss=True)(rows)
    tokenizer = processor.tokenizer
    image_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    for i, row in enumerate(rows):
        ids, labels, mask = batch["input_ids"][i], batch["labels"][i], batch["attention_mask"][i].bool()
        completion_ids = tokenizer(
            processor.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)[
                len(processor.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)) :
            ],
            add_special_tokens=False,
        )["input_ids"]
        n_real = int(mask.sum())
        prompt_len = n_real - len(completion_ids)
        assert (ids[:prompt_len] == image_id).sum() > 0  # the prompt holds the image's tokens
        assert (labels[:prompt_len] == -100).all() and (labels[n_real:] == -100).all()
        assert labels[prompt_len:n_real].tolist() == completion_ids


@requires_qwen2_vl_processor
def test_sft_assistant_only_loss_on_messages(tmp_path):
    data = load_test_dataset("vision_conversational_language_modeling")
    trainer = SFTTrainer(
        model=get_model_path("tiny-Qwen2VLForConditionalGeneration"),
        args=sft_args(tmp_path, assistant_only_loss=True),
        train_dataset=data["train"],
        eval_dataset=data["test"],
    )
    batch = trainer.data_collator([data["train"][0]])
    labelled = batch["input_ids"][0][batch["labels"][0] != -100]
    assert trainer.processing_class.tokenizer.decode(labelled) == "A red square.<|im_end|>"
    train_and_check_metrics(trainer, SFT_METRICS)
    assert_saved_model_reloads(trainer, tmp_path / "saved", AutoModelForImageTextToText)


@requires_qwen2_vl_processor
def test_truncation_never_cuts_image_tokens():
    processor = AutoProcessor.from_pretrained(get_model_path("tiny-Qwen2VLForConditionalGeneration"))
    rows = [load_test_dataset("vision_conversational_prompt_completion", "train")[0]]
    kept = DataCollatorForVisionLanguageModeling(processor, max_length=45)(rows)
    assert kept["input_ids"].shape[1] == 45
    with pytest.raises(ValueError, match="cut through an image"):
        DataCollatorForVisionLanguageModeling(processor, max_length=20)(rows)
    with pytest.raises(ValueError, match="cut through an image"):
        DataCollatorForVisionPreference(processor, max_length=20)(
            [load_test_dataset("vision_conversational_preference", "train")[0]]
        )


@pytest.mark.parametrize(
    "name", vlm_layouts("tiny-Qwen2VLForConditionalGeneration", "tiny-Idefics3ForConditionalGeneration")
)
def test_dpo_with_images_logs_metrics(name, tmp_path):
    data = load_test_dataset("vision_conversational_preference")
    trainer = DPOTrainer(
        model=get_model_path(name), args=dpo_args(tmp_path), train_dataset=data["train"], eval_dataset=data["test"]
    )
    assert isinstance(trainer.data_collator, DataCollatorForVisionPreference)
    batch = trainer.data_collator([data["train"][0], data["train"][1]])
    assert batch["input_ids"].shape[0] == 4 and "pixel_values" in batch and "completion_mask" in batch
    metrics = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"]
    train_and_check_metrics(trainer, metrics)


def test_kto_with_images_logs_metrics(tmp_path):
    data = load_test_dataset("vision_conversational_unpaired_preference")
    trainer = KTOTrainer(
        model=get_model_path("tiny-LlavaForConditionalGeneration"),
        args=kto_args(tmp_path),
        train_dataset=data["train"],
        eval_dataset=data["test"],
    )
    assert isinstance(trainer.data_collator, DataCollatorForVisionUnpairedPreference)
    batch = trainer.data_collator([data["train"][i] for i in range(3)])
    assert {"KL_input_ids", "KL_completion_mask", "label", "pixel_values"} <= set(batch)
    train_and_check_metrics(trainer, ["loss", "kl", "rewards/chosen", "logps/chosen"])


@requires_qwen2_vl_processor
def test_images_with_text_only_tokenizer_fail_clearly(tmp_path):
    path = get_model_path("tiny-Qwen2VLForConditionalGeneration")
    tokenizer = AutoProcessor.from_pretrained(path).tokenizer
    data = load_test_dataset("vision_conversational_prompt_completion", "train")
    with pytest.raises(ValueError, match="text-only tokenizer"):
        SFTTrainer(model=path, args=sft_args(tmp_path), train_dataset=data, processing_class=tokenizer)
    pref = load_test_dataset("vision_conversational_preference", "train")
    with pytest.raises(ValueError, match="text-only tokenizer"):
        DPOTrainer(model=path, args=dpo_args(tmp_path), train_dataset=pref, processing_class=tokenizer)


@requires_qwen2_vl_processor
def test_image_placeholders_without_images_fail_clearly(tmp_path):
    path = get_model_path("tiny-Qwen2VLForConditionalGeneration")
    data = load_test_dataset("vision_conversational_prompt_completion", "train").remove_columns("images")
    with pytest.raises(ValueError, match="no 'images'"):
        SFTTrainer(model=path, args=sft_args(tmp_path), train_dataset=data)


def test_text_only_dataset_with_vlm_processor_trains(tmp_path):
    # As in TRL: a processor is accepted wherever a tokenizer is; plain text rows train the language model.
    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": "What colour is the sky?"}]] * 4,
            "completion": [[{"role": "assistant", "content": "Blue."}]] * 4,
        }
    )
    trainer = SFTTrainer(
        model=get_model_path("tiny-LlavaForConditionalGeneration"), args=sft_args(tmp_path), train_dataset=data
    )
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)


@pytest.mark.parametrize("option", [{"packing": True}, {"padding_free": True, "max_length": None}])
def test_sft_rejects_packing_and_padding_free_with_images(option, tmp_path):
    data = load_test_dataset("vision_conversational_prompt_completion", "train")
    with pytest.raises(ValueError, match="not supported for vision datasets"):
        SFTTrainer(
            model=get_model_path("tiny-LlavaForConditionalGeneration"),
            args=sft_args(tmp_path, **option),
            train_dataset=data,
        )


def test_dpo_rejects_precomputed_reference_with_images(tmp_path):
    data = load_test_dataset("vision_conversational_preference", "train")
    with pytest.raises(ValueError, match="precompute_ref_log_probs"):
        DPOTrainer(
            model=get_model_path("tiny-LlavaForConditionalGeneration"),
            args=dpo_args(tmp_path, precompute_ref_log_probs=True),
            train_dataset=data,
        )


@pytest.mark.parametrize(
    "name, columns",
    [
        ("vision_conversational_language_modeling", ["images", "messages"]),
        ("vision_conversational_prompt_completion", ["completion", "images", "prompt"]),
        ("vision_conversational_prompt_only", ["images", "prompt"]),
        ("vision_conversational_preference", ["chosen", "images", "prompt", "rejected"]),
        ("vision_conversational_unpaired_preference", ["completion", "images", "label", "prompt"]),
        ("vision_standard_prompt_only", ["image", "prompt"]),
    ],
)
def test_image_datasets_hold_pil_images(name, columns):
    data = load_test_dataset(name)
    assert (data["train"].num_rows, data["test"].num_rows) == (24, 8)
    row = data["train"][0]
    assert sorted(row) == columns
    image = row["image"] if "image" in row else row["images"][0]
    assert isinstance(image, PIL.Image.Image) and image.mode == "RGB"


# ---------------------------------------------------------------------------------------------------------------------
# Online trainers (GRPO, RLOO): generation from prompts with images through transformers' generate
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trainer_name", ["grpo", "rloo"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_online_trainers_generate_per_image_and_rewards_see_images(trainer_name, name, tmp_path):
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    config_class, trainer_class = (GRPOConfig, GRPOTrainer) if trainer_name == "grpo" else (RLOOConfig, RLOOTrainer)
    seen = []
    image_reward = recording_image_reward(seen)
    args = config_class(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    data = load_test_dataset("vision_conversational_prompt_only", "train")
    trainer = trainer_class(model=get_model_path(name), reward_funcs=image_reward, args=args, train_dataset=data)
    image_token = trainer.processing_class.image_token_id
    assert trainer.generation_config.suppress_tokens == [image_token]
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    assert_rewards_saw_group_images(seen)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert "rewards/image_reward/mean" in logs[-1] and logs[-1]["num_tokens"] > 0


@requires_qwen2_vl_processor
def test_vision_rows_round_trip_grid_batch():
    from trl.trainer.utils.vision import collate_vision_rows, vision_rows_from_batch

    processor = AutoProcessor.from_pretrained(get_model_path("tiny-Qwen2VLForConditionalGeneration"))
    rows = [load_test_dataset("vision_conversational_prompt_only", "train")[i] for i in range(3)]
    texts = [processor.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    encoded = processor(
        text=texts, images=[r["images"] for r in rows], padding=True, padding_side="left", return_tensors="pt"
    )
    per_row = vision_rows_from_batch(encoded, [1, 1, 1])
    width = encoded["input_ids"].shape[1]
    merged = collate_vision_rows(per_row, width, width + 2)
    assert torch.equal(merged["pixel_values"], encoded["pixel_values"])
    assert torch.equal(merged["image_grid_thw"], encoded["image_grid_thw"])
    assert torch.equal(merged["mm_token_type_ids"][:, :width], encoded["mm_token_type_ids"])
    assert merged["mm_token_type_ids"][:, width:].eq(0).all()
    # A subset of rows in another order takes exactly those rows' patches.
    subset = collate_vision_rows([per_row[2], per_row[0]], width, width)
    patches = encoded["image_grid_thw"].prod(dim=-1).tolist()
    expected = torch.cat([encoded["pixel_values"][sum(patches[:2]) :], encoded["pixel_values"][: patches[0]]])
    assert torch.equal(subset["pixel_values"], expected)


def test_peft_on_language_model_only(tmp_path):
    peft = pytest.importorskip("peft")
    # As in TRL, target_modules are matched by PEFT; a regex on the module path keeps LoRA off the vision tower.
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    data = load_test_dataset("vision_conversational_prompt_completion", "train")
    trainer = SFTTrainer(
        model=get_model_path("tiny-LlavaForConditionalGeneration"),
        args=sft_args(tmp_path),
        train_dataset=data,
        peft_config=config,
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("language_model" in n and "lora_" in n for n in trainable)
    before = snapshot(trainer.model)
    trainer.train()
    changed = changed_params(before, trainer.model, trainable_only=False)
    assert changed and all("lora_" in n for n in changed)


# ---------------------------------------------------------------------------------------------------------------------
# Resuming from a checkpoint (weights saved under the models' original checkpoint names)
# ---------------------------------------------------------------------------------------------------------------------
def _interrupted_equals_uninterrupted(trainer_class, make_args, name, data, tmp_path):
    """Train 4 steps saving at step 2; a fresh trainer resumed from `checkpoint-2` ends on the same parameters."""
    args = dict(max_steps=4, save_strategy="steps", save_steps=2, seed=0)
    full = trainer_class(model=get_model_path(name), args=make_args(tmp_path / "full", **args), train_dataset=data)
    full.train()
    resumed = trainer_class(
        model=get_model_path(name), args=make_args(tmp_path / "resumed", **args), train_dataset=data
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    for param_name, param in full.model.named_parameters():
        assert torch.equal(param, resumed.model.get_parameter(param_name)), param_name
    return resumed


@pytest.mark.parametrize("name", LAYOUTS)
def test_sft_resume_from_checkpoint_matches_uninterrupted_run(name, tmp_path):
    data = load_test_dataset("vision_conversational_prompt_completion", "train")
    resumed = _interrupted_equals_uninterrupted(SFTTrainer, sft_args, name, data, tmp_path)
    assert_saved_model_reloads(resumed, tmp_path / "final", model_class=AutoModelForImageTextToText)


def test_dpo_resume_from_checkpoint_matches_uninterrupted_run(tmp_path):
    data = load_test_dataset("vision_conversational_preference", "train")
    name = "tiny-LlavaForConditionalGeneration"
    resumed = _interrupted_equals_uninterrupted(DPOTrainer, dpo_args, name, data, tmp_path)
    assert_saved_model_reloads(resumed, tmp_path / "final", model_class=AutoModelForImageTextToText)

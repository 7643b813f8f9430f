"""Supervised fine-tuning of a vision-language model on a dataset with images.

Runs offline on the embedded tiny assets (a Qwen2-VL-style model and a small image dataset) when no model or dataset
is given:

```bash
python examples/scripts/sft_vlm.py --output_dir sft-vlm-example --max_steps 20
# your own model and data (a dataset with `images` and conversational `messages` or `prompt`/`completion`)
python examples/scripts/sft_vlm.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> \
    --output_dir sft-vlm-out --use_peft --lora_target_modules q_proj v_proj
```

Rows are processed at batch time by `DataCollatorForVisionLanguageModeling` (the processor renders the chat template,
turns the images into pixel values and expands the image tokens). To freeze the vision tower, set
`requires_grad=False` on its parameters before creating the trainer, as done by `--freeze_vision_tower` here.
"""

from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser, get_peft_config


@dataclass
class VisionArguments:
    freeze_vision_tower: bool = field(default=False, metadata={"help": "Keep the vision encoder's weights fixed."})


def load_vision_dataset(script_args: ScriptArguments):
    if script_args.dataset_name is None:
        from trl.assets import load_test_dataset

        return load_test_dataset("vision_conversational_prompt_completion")
    import os

    from datasets import load_dataset, load_from_disk

    if os.path.isfile(os.path.join(script_args.dataset_name, "dataset_dict.json")):  # a `save_to_disk` directory
        return load_from_disk(script_args.dataset_name)
    return load_dataset(script_args.dataset_name, name=script_args.dataset_config)


def freeze_vision_tower(model) -> None:
    inner = getattr(model, "model", model)
    for name in ("visual", "vision_tower", "vision_model"):
        if hasattr(inner, name):
            for param in getattr(inner, name).parameters():
                param.requires_grad_(False)


def main(script_args, training_args, model_args, vision_args):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if model_args.model_name_or_path is None:
        from trl.assets import get_model_path

        model_args.model_name_or_path = get_model_path("tiny-Qwen2VLForConditionalGeneration")
    model = AutoModelForImageTextToText.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, dtype=model_args.dtype
    )
    processor = AutoProcessor.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    if vision_args.freeze_vision_tower:
        freeze_vision_tower(model)
    dataset = load_vision_dataset(script_args)
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        processing_class=processor,
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, VisionArguments))
    main(*parser.parse_args_and_config())

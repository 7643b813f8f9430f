"""GRPO on a vision-language model: completions generated from prompts with images, rewards that see the images.

Runs offline on the embedded tiny assets (a Qwen2-VL-style model and a small image prompt dataset) when no model or
dataset is given:

```bash
python examples/scripts/grpo_vlm.py --output_dir grpo-vlm-example --max_steps 20
python examples/scripts/grpo_vlm.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> \
    --output_dir grpo-vlm-out
```

Each reward function receives the prompts (with the images in their messages), the completions and the row's other
columns, `images` included. Generation uses transformers' `generate`; the image token is never sampled.
"""

from trl import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config


def short_answer_reward(completions, **kwargs):
    """Prefer answers of about five words."""
    return [-abs(len(completion[0]["content"].split()) - 5) / 5 for completion in completions]


def image_contrast_reward(completions, images, **kwargs):
    """A reward that looks at the image: longer answers for images with more contrast (a toy criterion)."""
    rewards = []
    for completion, row_images in zip(completions, images):
        low, high = row_images[0].convert("L").getextrema()
        rewards.append((high - low) / 255 * min(len(completion[0]["content"]), 40) / 40)
    return rewards


def main(script_args, training_args, model_args):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if model_args.model_name_or_path is None:
        from trl.assets import get_model_path

        model_args.model_name_or_path = get_model_path("tiny-Qwen2VLForConditionalGeneration")
    if script_args.dataset_name is None:
        from trl.assets import load_test_dataset

        dataset = load_test_dataset("vision_conversational_prompt_only")
    else:
        import os

        from datasets import load_dataset, load_from_disk

        if os.path.isfile(os.path.join(script_args.dataset_name, "dataset_dict.json")):  # a `save_to_disk` directory
            dataset = load_from_disk(script_args.dataset_name)
        else:
            dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    model = AutoModelForImageTextToText.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, dtype=model_args.dtype
    )
    processor = AutoProcessor.from_pretrained(
        model_args.model_name_or_path, revision=model_args.model_revision, padding_side="left"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[short_answer_reward, image_contrast_reward],
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        processing_class=processor,
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())

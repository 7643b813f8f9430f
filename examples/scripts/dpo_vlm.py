"""Direct Preference Optimization of a vision-language model on preference pairs with images.

Runs offline on the embedded tiny assets (a Qwen2-VL-style model and a small image preference dataset) when no
model or dataset is given:

```bash
python examples/scripts/dpo_vlm.py --output_dir dpo-vlm-example --max_steps 20
python examples/scripts/dpo_vlm.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> \
    --output_dir dpo-vlm-out
```

Rows (`prompt`, `chosen`, `rejected`, `images`) are processed at batch time by `DataCollatorForVisionPreference`.
Reference log-probabilities cannot be precomputed for image datasets.
"""

from trl import DPOConfig, DPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config


def main(script_args, training_args, model_args):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if model_args.model_name_or_path is None:
        from trl.assets import get_model_path

        model_args.model_name_or_path = get_model_path("tiny-Qwen2VLForConditionalGeneration")
    if script_args.dataset_name is None:
        from trl.assets import load_test_dataset

        dataset = load_test_dataset("vision_conversational_preference")
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
    processor = AutoProcessor.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    trainer = DPOTrainer(
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
    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())

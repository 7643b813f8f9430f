"""Process-supervised reward model (PRM) training example with the experimental `PRMTrainer`.

Runs offline on the embedded tiny assets when no model or dataset is given:

```bash
python examples/scripts/prm.py --output_dir prm-example --max_steps 20
accelerate launch examples/scripts/prm.py --output_dir prm-example --max_steps 20
# with your own model and stepwise-supervision data (prompt, completions, labels)
python examples/scripts/prm.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> \
    --output_dir prm-out --step_separator "\n" --use_peft --lora_r 32 --lora_alpha 16
```

The model is loaded with `AutoModelForTokenClassification` and 2 labels (a causal-LM checkpoint gets a fresh
`score` head). Each step's label is predicted on the last token of the separator that follows the step.
"""

import os

import torch
from transformers import AutoModelForTokenClassification, AutoTokenizer

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config
from trl.scripts._training import load_script_dataset, release_process_group, split_datasets
from trl.trainer import get_kbit_device_map


def main(script_args: ScriptArguments, training_args, model_args: ModelConfig) -> None:
    from trl.experimental.prm import PRMTrainer

    quantization_config = get_quantization_config(model_args)
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    model_kwargs = {
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "dtype": dtype,
        "quantization_config": quantization_config,
        "device_map": get_kbit_device_map() if quantization_config is not None else None,
    }
    model_kwargs = {key: value for key, value in model_kwargs.items() if value is not None}
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    model = AutoModelForTokenClassification.from_pretrained(
        model_args.model_name_or_path, num_labels=2, **model_kwargs
    )
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id

    dataset = load_script_dataset(script_args, None)
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)
    trainer = PRMTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if training_args.eval_strategy != "no":
        trainer.log(trainer.evaluate())
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    release_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.prm import PRMConfig

    parser = TrlParser((ScriptArguments, PRMConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    if model_args.model_name_or_path is None or script_args.dataset_name is None:
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path(
            "tiny-Qwen2ForTokenClassification"
        )
        script_args.dataset_name = script_args.dataset_name or get_dataset_path("standard_stepwise_supervision")
    main(script_args, training_args, model_args)

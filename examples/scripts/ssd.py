"""Simple Self-Distillation (SSD) example.

The model samples one completion per prompt and is fine-tuned on its own completions (cross-entropy), the empty
and stub ones left out. Meant for code generation (prompts asking for a program); any dataset with a `prompt`
column works. Runs offline on the embedded tiny assets when no model or dataset is given:

```bash
python examples/scripts/ssd.py --output_dir ssd-example --max_steps 5 --per_device_train_batch_size 4 \
    --max_completion_length 16
python examples/scripts/ssd.py --model_name_or_path <model> --dataset_name <dataset with a prompt column> \
    --output_dir ssd-out --temperature 1.2 --max_completion_length 1024 --use_peft
```
"""

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from trl.experimental.ssd import SSDConfig, SSDTrainer
from trl.scripts._training import build_model_init_kwargs, finish_training, load_script_dataset, split_datasets
from trl.trainer.utils import get_peft_config


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, SSDConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if model_args.model_name_or_path is None or (script_args.dataset_name is None and not dataset_args.datasets):
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("standard_prompt_only")

    training_args.model_init_kwargs = build_model_init_kwargs(model_args, training_args)
    dataset = load_script_dataset(script_args, dataset_args)
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)
    trainer = SSDTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    finish_training(trainer, training_args, script_args)

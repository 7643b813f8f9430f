"""Self-Distillation Fine-Tuning (SDFT) example.

The student samples completions of each prompt; the teacher is the same model reading the prompt together with
privileged context (a demonstration, a hint, the answer) and the student learns to match it. The dataset needs a
`prompt` column and either `privileged_context` or `golden_response` (turned into privileged context by
`--context_template`). Runs offline on the embedded tiny assets when no model or dataset is given (the tiny prompts,
each with a made-up hint as its context):

```bash
python examples/scripts/sdft.py --output_dir sdft-example --max_steps 5 --num_generations 2 \
    --per_device_train_batch_size 4 --max_completion_length 16
python examples/scripts/sdft.py --model_name_or_path <model> --dataset_name <dataset with prompt + golden_response> \
    --output_dir sdft-out --teacher_model_kind ema --distillation_mode topk_logits --use_peft
```
"""

from dataclasses import dataclass, field

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from trl.experimental.sdft import SDFTConfig, SDFTTrainer
from trl.scripts._training import build_model_init_kwargs, finish_training, load_script_dataset, split_datasets
from trl.trainer.utils import get_peft_config


@dataclass
class SDFTScriptArguments(ScriptArguments):
    """Script arguments plus how privileged context is built from a `golden_response` column."""

    context_template: str = field(
        default="Here is an example answer:\n{golden_response}",
        metadata={"help": "Privileged context built from `golden_response` when `privileged_context` is absent."},
    )


def with_privileged_context(dataset, template: str):
    """Add `privileged_context` when the dataset has `golden_response` (or neither: a placeholder hint per row)."""
    columns = dataset.column_names
    if "privileged_context" in columns:
        return dataset
    if "golden_response" in columns:
        return dataset.map(lambda row: {"privileged_context": template.format(golden_response=row["golden_response"])})
    return dataset.map(lambda row, i: {"privileged_context": f"Hint {i}: answer briefly."}, with_indices=True)


if __name__ == "__main__":
    parser = TrlParser((SDFTScriptArguments, SDFTConfig, ModelConfig, DatasetMixtureConfig))
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
    dataset = {split: with_privileged_context(data, script_args.context_template) for split, data in dataset.items()}
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)
    trainer = SDFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    finish_training(trainer, training_args, script_args)

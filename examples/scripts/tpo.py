"""Triple Preference Optimization (TPO) example.

TPO trains on triples: a gold `reference` completion (learned with a cross-entropy term), a `chosen` and a `rejected`
one (compared by a reference-free preference term). Rated datasets in UltraFeedback's layout (`instruction` and a list
of `completions` with `response` and `overall_score`) are turned into triples: the best-scored response is the
reference, the second best the chosen one and the worst the rejected one; datasets that already hold `chosen`,
`rejected` and `reference` are used as they are. Runs offline on the embedded tiny assets when no model or dataset is
given (the tiny preference data, its chosen completion doubling as the reference):

```bash
python examples/scripts/tpo.py --output_dir tpo-example --max_steps 20
python examples/scripts/tpo.py --model_name_or_path <model dir or id> --dataset_name openbmb/UltraFeedback \
    --output_dir tpo-out --loss_type tpo-l --beta 2.0 --tpo_alpha 1.0
```
"""

from typing import Any

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from trl.experimental.tpo import TPOConfig, TPOTrainer
from trl.scripts._training import build_model_init_kwargs, finish_training, load_script_dataset, split_datasets
from trl.trainer.utils import get_peft_config


def as_conversation(text: Any, role: str) -> Any:
    """Plain strings become one-message conversations; message lists are kept."""
    return [{"role": role, "content": text}] if isinstance(text, str) else text


def rated_to_triple(example: dict[str, Any]) -> dict[str, Any]:
    """UltraFeedback-style row -> TPO triple (best response: reference, second: chosen, worst: rejected)."""
    ranked = sorted(example["completions"], key=lambda c: c["overall_score"], reverse=True)
    return {
        "prompt": as_conversation(example["instruction"], "user"),
        "reference": as_conversation(ranked[0]["response"], "assistant"),
        "chosen": as_conversation(ranked[1]["response"], "assistant"),
        "rejected": as_conversation(ranked[-1]["response"], "assistant"),
    }


def to_triples(dataset: Any) -> Any:
    columns = dataset.column_names
    if "completions" in columns and "instruction" in columns:
        dataset = dataset.filter(lambda row: len(row["completions"]) >= 3)
        return dataset.map(rated_to_triple, remove_columns=columns)
    if "reference" not in columns:  # the offline fallback: the preferred completion doubles as the gold one
        return dataset.map(lambda row: {"reference": row["chosen"]})
    return dataset


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, TPOConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if model_args.model_name_or_path is None or (script_args.dataset_name is None and not dataset_args.datasets):
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("conversational_preference")

    training_args.model_init_kwargs = build_model_init_kwargs(model_args, training_args)
    dataset = load_script_dataset(script_args, dataset_args)
    dataset = {split: to_triples(data) for split, data in dataset.items()}
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)
    trainer = TPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    finish_training(trainer, training_args, script_args)

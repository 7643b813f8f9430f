"""Self-Distillation Policy Optimization (SDPO) example.

Completions are scored by reward functions; the teacher of a failing completion is the same model shown a successful
completion of the same prompt (and, with `--include_environment_feedback`, the row's feedback). With a GSM8K-style
dataset (`prompt` and `solution` columns) the rewards are TRL's `accuracy_reward` plus `think_format_reward`; a
`--feedback_column` is passed to the teacher as `privileged_context`. Runs offline on the embedded tiny assets when no
model or dataset is given (a toy reward marks about half of the random completions as successes):

```bash
python examples/scripts/sdpo.py --output_dir sdpo-example --max_steps 5 --num_generations 4 \
    --per_device_train_batch_size 4 --max_completion_length 16
python examples/scripts/sdpo.py --model_name_or_path <model> --dataset_name <prompt + solution dataset> \
    --output_dir sdpo-out --distillation_weight 0.5 --use_peft
```
"""

from dataclasses import dataclass, field

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from trl.experimental.sdpo import SDPOConfig, SDPOTrainer
from trl.scripts._training import build_model_init_kwargs, finish_training, load_script_dataset, split_datasets
from trl.trainer.utils import get_peft_config


@dataclass
class SDPOScriptArguments(ScriptArguments):
    """Script arguments plus the column holding environment feedback."""

    feedback_column: str | None = field(
        default=None, metadata={"help": "Column passed to the teacher as `privileged_context` (environment feedback)."}
    )


def toy_success_reward(completion_ids, **kwargs) -> list[float]:
    """1 when at least a quarter of the completion's token ids are even (a stand-in for correctness offline)."""
    return [1.0 if sum(1 for t in ids if t % 2 == 0) >= len(ids) / 4 else 0.0 for ids in completion_ids]


def reward_functions(columns: list[str]) -> list:
    """Accuracy and format rewards when the data has reference solutions; the toy reward otherwise."""
    if "solution" in columns:
        from trl.rewards import accuracy_reward, think_format_reward

        return [accuracy_reward, think_format_reward]
    return [toy_success_reward]


if __name__ == "__main__":
    parser = TrlParser((SDPOScriptArguments, SDPOConfig, ModelConfig, DatasetMixtureConfig))
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
    if script_args.feedback_column is not None:
        dataset = {
            split: data.rename_column(script_args.feedback_column, "privileged_context")
            for split, data in dataset.items()
        }
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)
    trainer = SDPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_functions(train_dataset.column_names),
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    finish_training(trainer, training_args, script_args)

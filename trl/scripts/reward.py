"""Reward-model training script behind `trl reward`.

Examples:

```bash
# plain python, one process
python trl/scripts/reward.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> --output_dir out

# through the CLI (runs this file with accelerate launch) with a YAML config
trl reward --config examples/cli_configs/reward.yaml

# LoRA (the score head is trained and saved with the adapter)
trl reward --model_name_or_path <model> --dataset_name <dataset> --use_peft --lora_r 16 --output_dir out
```
"""

import argparse

from trl import (
    DatasetMixtureConfig,
    ModelConfig,
    RewardConfig,
    RewardTrainer,
    ScriptArguments,
    TrlParser,
    get_peft_config,
)
from trl.scripts._training import build_model_init_kwargs, finish_training, load_script_dataset, split_datasets


def main(
    script_args: ScriptArguments,
    training_args: RewardConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig | None = None,
) -> None:
    """Train a reward model from `model_args.model_name_or_path` on the selected preference dataset."""
    training_args.model_init_kwargs = build_model_init_kwargs(model_args, training_args)
    dataset = load_script_dataset(script_args, dataset_args)
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)
    trainer = RewardTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    finish_training(trainer, training_args, script_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for the script's dataclasses (registered as the `reward` sub-command when `subparsers` is given)."""
    dataclass_types = (ScriptArguments, RewardConfig, ModelConfig, DatasetMixtureConfig)
    if subparsers is not None:
        return subparsers.add_parser("reward", help="Run the reward training script", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


if __name__ == "__main__":
    parser = make_parser()
    # `dataset_args` is last so that dataclasses without `datasets` in the YAML still parse.
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    main(script_args, training_args, model_args, dataset_args)

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
)
from trl.scripts._training import make_script_parser, run_script, train_with_trainer


def main(
    script_args: ScriptArguments,
    training_args: RewardConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig | None = None,
) -> None:
    """Train a reward model from `model_args.model_name_or_path` on the selected preference dataset."""
    train_with_trainer(RewardTrainer, script_args, training_args, model_args, dataset_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for the script's dataclasses (registered as the `reward` sub-command when `subparsers` is given)."""
    dataclass_types = (ScriptArguments, RewardConfig, ModelConfig, DatasetMixtureConfig)
    return make_script_parser("reward", "Run the reward training script", dataclass_types, subparsers, prog)


if __name__ == "__main__":
    run_script(make_parser, main)

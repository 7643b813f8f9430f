"""Supervised fine-tuning script behind `trl sft`.

Examples:

```bash
# plain python, one process
python trl/scripts/sft.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> --output_dir out

# through the CLI (runs this file with accelerate launch) with a YAML config
trl sft --config examples/cli_configs/sft.yaml

# LoRA
trl sft --model_name_or_path <model> --dataset_name <dataset> --use_peft --lora_r 16 --output_dir out
```
"""

import argparse

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser
from trl.scripts._training import make_script_parser, run_script, train_with_trainer


def main(
    script_args: ScriptArguments,
    training_args: SFTConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig | None = None,
) -> None:
    """Fine-tune `model_args.model_name_or_path` on the selected dataset with [`SFTTrainer`]."""
    train_with_trainer(SFTTrainer, script_args, training_args, model_args, dataset_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for the script's dataclasses (registered as the `sft` sub-command when `subparsers` is given)."""
    dataclass_types = (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig)
    return make_script_parser("sft", "Run the SFT training script", dataclass_types, subparsers, prog)


if __name__ == "__main__":
    run_script(make_parser, main)

"""Kahneman-Tversky Optimization script behind `trl kto`.

Examples:

```bash
# plain python, one process
python trl/scripts/kto.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> --output_dir out

# through the CLI (runs this file with accelerate launch) with a YAML config
trl kto --config examples/cli_configs/kto.yaml

# LoRA: the reference is the same model with its adapters disabled (no second copy in memory)
trl kto --model_name_or_path <model> --dataset_name <dataset> --use_peft --lora_r 16 --output_dir out

# unbalanced data: weight the rarer class up, or use the unpaired APO-zero loss
trl kto ... --undesirable_weight 1.5
trl kto ... --loss_type apo_zero_unpaired
```

The dataset may be unpaired (`prompt`, `completion`, `label`) or paired (`prompt`, `chosen`, `rejected`), in which
case it is unpaired automatically.
"""

import argparse

from trl import DatasetMixtureConfig, KTOConfig, KTOTrainer, ModelConfig, ScriptArguments, TrlParser
from trl.scripts._training import make_script_parser, run_script, train_with_trainer


def main(
    script_args: ScriptArguments,
    training_args: KTOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig | None = None,
) -> None:
    """Train `model_args.model_name_or_path` on the selected (un)paired preference dataset with [`KTOTrainer`]."""
    train_with_trainer(KTOTrainer, script_args, training_args, model_args, dataset_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for the script's dataclasses (registered as the `kto` sub-command when `subparsers` is given)."""
    dataclass_types = (ScriptArguments, KTOConfig, ModelConfig, DatasetMixtureConfig)
    return make_script_parser("kto", "Run the KTO training script", dataclass_types, subparsers, prog)


if __name__ == "__main__":
    run_script(make_parser, main)

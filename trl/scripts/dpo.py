"""Direct Preference Optimization script behind `trl dpo`.

Examples:

```bash
# plain python, one process
python trl/scripts/dpo.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> --output_dir out

# through the CLI (runs this file with accelerate launch) with a YAML config
trl dpo --config examples/cli_configs/dpo.yaml

# LoRA: the reference is the same model with its adapters disabled (no second copy in memory)
trl dpo --model_name_or_path <model> --dataset_name <dataset> --use_peft --lora_r 16 --output_dir out

# another loss, or several with weights (MPO)
trl dpo ... --loss_type sigmoid bco_pair sft --loss_weights 0.8 0.2 1.0
```
"""

import argparse

from trl import DatasetMixtureConfig, DPOConfig, DPOTrainer, ModelConfig, ScriptArguments, TrlParser
from trl.scripts._training import make_script_parser, run_script, train_with_trainer


def main(
    script_args: ScriptArguments,
    training_args: DPOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig | None = None,
) -> None:
    """Train `model_args.model_name_or_path` on the selected preference dataset with [`DPOTrainer`]."""
    train_with_trainer(DPOTrainer, script_args, training_args, model_args, dataset_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for the script's dataclasses (registered as the `dpo` sub-command when `subparsers` is given)."""
    dataclass_types = (ScriptArguments, DPOConfig, ModelConfig, DatasetMixtureConfig)
    return make_script_parser("dpo", "Run the DPO training script", dataclass_types, subparsers, prog)


if __name__ == "__main__":
    run_script(make_parser, main)

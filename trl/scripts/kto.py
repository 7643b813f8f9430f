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

from trl import DatasetMixtureConfig, KTOConfig, KTOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config
from trl.scripts._training import build_model_init_kwargs, finish_training, load_script_dataset, split_datasets


def main(
    script_args: ScriptArguments,
    training_args: KTOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig | None = None,
) -> None:
    """Train `model_args.model_name_or_path` on the selected (un)paired preference dataset with [`KTOTrainer`]."""
    training_args.model_init_kwargs = build_model_init_kwargs(model_args, training_args)
    dataset = load_script_dataset(script_args, dataset_args)
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)
    trainer = KTOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    finish_training(trainer, training_args, script_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for the script's dataclasses (registered as the `kto` sub-command when `subparsers` is given)."""
    dataclass_types = (ScriptArguments, KTOConfig, ModelConfig, DatasetMixtureConfig)
    if subparsers is not None:
        return subparsers.add_parser("kto", help="Run the KTO training script", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


if __name__ == "__main__":
    parser = make_parser()
    # `dataset_args` is last so that dataclasses without `datasets` in the YAML still parse.
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    main(script_args, training_args, model_args, dataset_args)

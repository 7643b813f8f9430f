"""On-policy distillation script behind `trl distillation`.

Examples:

```bash
# plain python, one process
python trl/scripts/distillation.py --model_name_or_path <student> --teacher_model_name_or_path <teacher> \
    --dataset_name <prompt-only dataset> --output_dir out

# through the CLI (runs this file with accelerate launch) with a YAML config
trl distillation --config examples/cli_configs/distillation.yaml
```
"""

import argparse

from trl import DatasetMixtureConfig, DistillationConfig, DistillationTrainer, ModelConfig, ScriptArguments, TrlParser
from trl.scripts._training import make_script_parser, run_script, train_with_trainer


def main(
    script_args: ScriptArguments,
    training_args: DistillationConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig | None = None,
) -> None:
    """Distil `training_args.teacher_model_name_or_path` into `model_args.model_name_or_path` on the selected
    prompts with [`DistillationTrainer`]."""
    if training_args.teacher_model_name_or_path is None:
        raise ValueError(
            "trl distillation needs a teacher: pass --teacher_model_name_or_path <path or hub id> (or set "
            "teacher_model_name_or_path in the YAML config)."
        )
    train_with_trainer(
        DistillationTrainer,
        script_args,
        training_args,
        model_args,
        dataset_args,
        teacher_model=training_args.teacher_model_name_or_path,
    )


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for the script's dataclasses (registered as the `distillation` sub-command when `subparsers` is given)."""
    dataclass_types = (ScriptArguments, DistillationConfig, ModelConfig, DatasetMixtureConfig)
    return make_script_parser(
        "distillation", "Run the distillation training script", dataclass_types, subparsers, prog
    )


if __name__ == "__main__":
    run_script(make_parser, main)

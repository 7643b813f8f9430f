"""REINFORCE Leave-One-Out script behind `trl rloo`.

Examples:

```bash
# plain python, one process
python trl/scripts/rloo.py --model_name_or_path <model> --dataset_name <prompt-only dataset> --output_dir out \
    --reward_model_name_or_path <sequence-classification model>

# through the CLI (runs this file with accelerate launch) with a YAML config
trl rloo --config examples/cli_configs/rloo.yaml --reward_funcs think_format_reward
```
"""

import argparse
from dataclasses import dataclass

from trl import DatasetMixtureConfig, ModelConfig, RLOOConfig, RLOOTrainer, TrlParser
from trl.scripts._training import make_script_parser, run_script, train_with_trainer
from trl.scripts.grpo import GRPOScriptArguments, build_reward_funcs


@dataclass
class RLOOScriptArguments(GRPOScriptArguments):
    """Dataset selection plus the reward sources of the RLOO script (the fields of `GRPOScriptArguments`).

    Args:
        reward_model_name_or_path (`str` or `None`, defaults to `None`):
            Path or hub id of a sequence-classification reward model, added to the reward functions.
        reward_funcs (`list[str]` or `None`, defaults to `None`):
            Reward functions by name: `accuracy_reward`, `reasoning_accuracy_reward`, `think_format_reward`,
            `get_soft_overlong_punishment` (max_completion_len=1280, soft_punish_cache=256), or a dotted import path
            `package.module.function` (the current directory is importable).
    """


def main(
    script_args: RLOOScriptArguments,
    training_args: RLOOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig | None = None,
) -> None:
    """Train `model_args.model_name_or_path` with [`RLOOTrainer`] on the selected prompts."""
    # Built before the dataset so that a bad reward name fails fast.
    reward_funcs = build_reward_funcs(script_args)
    train_with_trainer(RLOOTrainer, script_args, training_args, model_args, dataset_args, reward_funcs=reward_funcs)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for the script's dataclasses (registered as the `rloo` sub-command when `subparsers` is given)."""
    dataclass_types = (RLOOScriptArguments, RLOOConfig, ModelConfig, DatasetMixtureConfig)
    return make_script_parser("rloo", "Run the RLOO training script", dataclass_types, subparsers, prog)


if __name__ == "__main__":
    run_script(make_parser, main)

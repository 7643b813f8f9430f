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
from dataclasses import dataclass, field

from trl import DatasetMixtureConfig, ModelConfig, RLOOConfig, RLOOTrainer, ScriptArguments, TrlParser, get_peft_config
from trl.scripts._training import build_model_init_kwargs, finish_training, load_script_dataset, split_datasets
from trl.scripts.grpo import build_reward_funcs


@dataclass
class RLOOScriptArguments(ScriptArguments):
    """Dataset selection plus the reward sources of the RLOO script (same fields as `GRPOScriptArguments`).

    Args:
        reward_model_name_or_path (`str` or `None`, defaults to `None`):
            Path or hub id of a sequence-classification reward model, added to the reward functions.
        reward_funcs (`list[str]` or `None`, defaults to `None`):
            Reward functions by name: `accuracy_reward`, `reasoning_accuracy_reward`, `think_format_reward`,
            `get_soft_overlong_punishment` (max_completion_len=1280, soft_punish_cache=256), or a dotted import path
            `package.module.function` (the current directory is importable).
    """

    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Reward model (path or hub id) added to the reward functions."}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: accuracy_reward, reasoning_accuracy_reward, think_format_reward, "
            "get_soft_overlong_punishment, or dotted import paths such as my_module.my_reward."
        },
    )


def main(
    script_args: RLOOScriptArguments,
    training_args: RLOOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig | None = None,
) -> None:
    """Train `model_args.model_name_or_path` with [`RLOOTrainer`] on the selected prompts."""
    training_args.model_init_kwargs = build_model_init_kwargs(model_args, training_args)
    reward_funcs = build_reward_funcs(script_args)
    dataset = load_script_dataset(script_args, dataset_args)
    train_dataset, eval_dataset = split_datasets(dataset, script_args, training_args)
    trainer = RLOOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),
    )
    finish_training(trainer, training_args, script_args)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for the script's dataclasses (registered as the `rloo` sub-command when `subparsers` is given)."""
    dataclass_types = (RLOOScriptArguments, RLOOConfig, ModelConfig, DatasetMixtureConfig)
    if subparsers is not None:
        return subparsers.add_parser("rloo", help="Run the RLOO training script", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types, prog=prog)


if __name__ == "__main__":
    parser = make_parser()
    # `dataset_args` is last so that dataclasses without `datasets` in the YAML still parse.
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    main(script_args, training_args, model_args, dataset_args)

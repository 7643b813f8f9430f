"""Group Relative Policy Optimization script behind `trl grpo`.

Examples:

```bash
# plain python, one process, with a reward model and a built-in reward function
python trl/scripts/grpo.py --model_name_or_path <model> --dataset_name <prompt-only dataset> --output_dir out \
    --reward_model_name_or_path <sequence-classification model> --reward_funcs think_format_reward

# through the CLI (runs this file with accelerate launch) with a YAML config
trl grpo --config examples/cli_configs/grpo.yaml

# your own reward function, importable from the current directory: my_rewards.py defines `my_reward`
trl grpo --config examples/cli_configs/grpo.yaml --reward_funcs my_rewards.my_reward
```
"""

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from trl import DatasetMixtureConfig, GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser
from trl.scripts._training import make_script_parser, run_script, train_with_trainer


# Settings of `get_soft_overlong_punishment` when it is selected by name.
SOFT_OVERLONG_MAX_COMPLETION_LEN = 1280
SOFT_OVERLONG_CACHE = 256


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """Dataset selection plus the reward sources of the GRPO / RLOO scripts.

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


def _builtin_reward(name: str) -> Callable | None:
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    registry = {
        "accuracy_reward": lambda: accuracy_reward,
        "reasoning_accuracy_reward": lambda: reasoning_accuracy_reward,
        "think_format_reward": lambda: think_format_reward,
        "get_soft_overlong_punishment": lambda: get_soft_overlong_punishment(
            max_completion_len=SOFT_OVERLONG_MAX_COMPLETION_LEN, soft_punish_cache=SOFT_OVERLONG_CACHE
        ),
    }
    factory = registry.get(name)
    return factory() if factory is not None else None


def resolve_reward_func(name: str) -> Callable:
    """A reward function from a built-in name or a dotted import path (`package.module.function`)."""
    builtin = _builtin_reward(name)
    if builtin is not None:
        return builtin
    if "." in name:
        module_name, attribute = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(
                f"Could not import module {module_name!r} for reward function {name!r}: {error}"
            ) from error
        if not hasattr(module, attribute):
            raise ValueError(f"Module {module_name!r} has no attribute {attribute!r} (reward function {name!r}).")
        return getattr(module, attribute)
    raise ValueError(
        f"Unknown reward function {name!r}. Use one of accuracy_reward, reasoning_accuracy_reward, "
        "think_format_reward, get_soft_overlong_punishment, or a dotted path like my_module.my_reward."
    )


def build_reward_funcs(script_args: ScriptArguments) -> list:
    """Reward functions of a script run: the reward model (if any) followed by the named functions."""
    reward_funcs: list = []
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)
    for name in script_args.reward_funcs or []:
        reward_funcs.append(resolve_reward_func(name))
    if not reward_funcs:
        raise ValueError(
            "No reward given: pass --reward_model_name_or_path and/or --reward_funcs (e.g. think_format_reward)."
        )
    return reward_funcs


def main(
    script_args: GRPOScriptArguments,
    training_args: GRPOConfig,
    model_args: ModelConfig,
    dataset_args: DatasetMixtureConfig | None = None,
) -> None:
    """Train `model_args.model_name_or_path` with [`GRPOTrainer`] on the selected prompts."""
    # Built before the dataset so that a bad reward name fails fast.
    reward_funcs = build_reward_funcs(script_args)
    train_with_trainer(GRPOTrainer, script_args, training_args, model_args, dataset_args, reward_funcs=reward_funcs)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for the script's dataclasses (registered as the `grpo` sub-command when `subparsers` is given)."""
    dataclass_types = (GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig)
    return make_script_parser("grpo", "Run the GRPO training script", dataclass_types, subparsers, prog)


if __name__ == "__main__":
    run_script(make_parser, main)

"""GRPO on SETA, a terminal-agent environment of the OpenReward catalog (`Eigent/SETA`).

`OpenRewardSpec` turns the environment into the dataset (one row per task), the per-rollout environment (one
method per tool the environment serves) and the reward (the last reward the environment gave). Needs the OpenReward
SDK (`pip install trl[openreward]`) and an API key in `OPENREWARD_API_KEY`; `--environment` also takes another
catalog name or the URL of your own Open Reward Standard server (with `--env_name`):

```bash
export OPENREWARD_API_KEY=...
python examples/scripts/openreward/seta.py --model_name_or_path Qwen/Qwen3-1.7B --output_dir seta-grpo \
    --num_tasks 64 --max_completion_length 4096 --max_tool_calling_iterations 16
accelerate launch examples/scripts/openreward/seta.py --model_name_or_path Qwen/Qwen3-1.7B --output_dir seta-grpo \
    --use_vllm --vllm_mode colocate --use_peft
```

Without `--model_name_or_path` the embedded tiny test model is used (it shows the mechanics only).
"""

from dataclasses import dataclass, field

from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser
from trl.assets import get_model_path
from trl.experimental.openreward import OpenRewardSpec
from trl.trainer.utils import get_peft_config


@dataclass
class SETAArguments:
    """Which OpenReward environment and tasks to train on."""

    environment: str = field(
        default="Eigent/SETA", metadata={"help": "Catalog name, or the URL of an Open Reward Standard server."}
    )
    env_name: str | None = field(default=None, metadata={"help": "Environment name on an ORS server."})
    split: str = field(default="train", metadata={"help": "Task split."})
    num_tasks: int | None = field(default=None, metadata={"help": "Train on the first N tasks (default: all)."})


def build_trainer(seta_args: SETAArguments, training_args: GRPOConfig, model_args: ModelConfig) -> GRPOTrainer:
    """The GRPO trainer over the environment's tasks: dataset, environment factory and reward from `OpenRewardSpec`.

    Args:
        seta_args: The environment and task selection.
        training_args: The GRPO configuration (`max_tool_calling_iterations` bounds the turns of a rollout).
        model_args: The model id or path (the tiny offline model when missing) and the optional LoRA settings.
    """
    spec = OpenRewardSpec(
        seta_args.environment, split=seta_args.split, num_tasks=seta_args.num_tasks, env_name=seta_args.env_name
    )
    return GRPOTrainer(
        model=model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=spec.reward_funcs,
        args=training_args,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        peft_config=get_peft_config(model_args),
    )


def parse_args(argv: list[str] | None = None) -> tuple[SETAArguments, GRPOConfig, ModelConfig]:
    """The command line (or `argv`)."""
    parser = TrlParser((SETAArguments, GRPOConfig, ModelConfig))
    return parser.parse_args_and_config(args=argv)


if __name__ == "__main__":
    seta_args, training_args, model_args = parse_args()
    trainer = build_trainer(seta_args, training_args, model_args)
    trainer.train()
    trainer.save_model(training_args.output_dir)

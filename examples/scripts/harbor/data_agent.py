"""A data agent trained with GRPO on Harbor tasks.

Each task is a sandbox holding data files (`/home/user/input`) and a question; the model works through a harness's
tools and writes its answer to `/workdir/answer.txt`, which the task's verifier grades. `HarborSpec` turns the task
collection into the dataset, the per-rollout environment and the reward; three harnesses live in `harnesses/`:

- `bash`: one shell tool;
- `jupyter`: a notebook-like `python` tool whose variables persist between calls;
- `terminal_notes`: the shell plus `write_note` / `read_notes`, a notebook of findings kept in the sandbox.

`--harness` also takes any `HarborSpec` agent reference (`path/to/file.py:Class`, `pkg.module:Class`). Needs Harbor
(`pip install trl[harbor]`, Python >= 3.12) and its sandbox backend (Docker by default):

```bash
python examples/scripts/harbor/data_agent.py --tasks path/to/task-collection --harness jupyter \
    --model Qwen/Qwen3-1.7B --output_dir data-agent-grpo --num_tasks 64
accelerate launch examples/scripts/harbor/data_agent.py --tasks <org/harbor-dataset> --harness terminal_notes \
    --model Qwen/Qwen3-1.7B --output_dir data-agent-grpo --use_vllm --environment_type daytona
```

Without `--model` the embedded tiny test model is used (it shows the mechanics only).
"""

import argparse
import os

from trl import GRPOConfig, GRPOTrainer
from trl.assets import get_model_path
from trl.experimental.harbor import HarborSpec


HARNESS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harnesses")
# Harness name -> class in harnesses/<name>.py (referenced by file, so the script runs from any directory).
HARNESSES = {"bash": "BashHarness", "jupyter": "JupyterHarness", "terminal_notes": "TerminalNotesHarness"}

# The options passed on to `GRPOConfig` under the same names.
GRPO_OPTIONS = (
    "output_dir",
    "max_steps",
    "learning_rate",
    "per_device_train_batch_size",
    "num_generations",
    "max_completion_length",
    "max_tool_calling_iterations",
    "use_vllm",
    "report_to",
)


def harness_reference(harness: str) -> str:
    """The `HarborSpec` agent reference of a harness name; other references are passed through."""
    if harness in HARNESSES:
        return f"{os.path.join(HARNESS_DIR, harness)}.py:{HARNESSES[harness]}"
    return harness


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (or `argv`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", required=True, help="Harbor task collection: a local directory or a dataset repo.")
    parser.add_argument("--harness", default="bash", help=f"One of {sorted(HARNESSES)}, or 'path.py:Class'.")
    parser.add_argument("--environment_type", default="docker", help="Harbor sandbox backend (docker, daytona, ...).")
    parser.add_argument("--num_tasks", type=int, default=None, help="Train on the first N tasks (default: all).")
    parser.add_argument("--model", default=None, help="Model id or path (default: the tiny offline test model).")
    parser.add_argument("--output_dir", default="data-agent-grpo")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--learning_rate", type=float, default=1e-6)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=4096, help="Tokens over all turns of a rollout.")
    parser.add_argument("--max_tool_calling_iterations", type=int, default=16)
    parser.add_argument("--use_vllm", action="store_true", help="Generate with vLLM (colocated).")
    parser.add_argument("--report_to", default="none")
    return parser.parse_args(argv)


def build_trainer(args: argparse.Namespace) -> GRPOTrainer:
    """The GRPO trainer over the Harbor tasks: dataset, environment factory and verifier reward from `HarborSpec`."""
    spec = HarborSpec(
        args.tasks,
        agent=harness_reference(args.harness),
        environment_type=args.environment_type,
        num_tasks=args.num_tasks,
    )
    config = GRPOConfig(**{name: getattr(args, name) for name in GRPO_OPTIONS}, vllm_mode="colocate", logging_steps=1)
    return GRPOTrainer(
        model=args.model or get_model_path("tiny-Qwen2ForCausalLM"),
        reward_funcs=spec.reward_funcs,
        args=config,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    trainer = build_trainer(args)
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()

"""GRPO with tool calling: the model may call a `multiply` tool to answer arithmetic questions.

Runs offline on the embedded tiny assets by default (a random tiny model seldom writes a tool call, so the run shows
the mechanics); pass an instruction model whose chat template supports tool calling to train tool use for real:

```bash
python examples/scripts/grpo_tools.py --output_dir grpo-tools --max_steps 2 --per_device_train_batch_size 4 \
    --num_generations 4 --max_completion_length 48
python examples/scripts/grpo_tools.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --output_dir grpo-tools \
    --max_completion_length 256 --max_tool_calling_iterations 2
```
"""

import random
from dataclasses import dataclass, field

from datasets import Dataset

from trl import GRPOConfig, GRPOTrainer, TrlParser


@dataclass
class ToolScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model path or id; the embedded tiny Qwen2 model when omitted."}
    )
    num_questions: int = field(default=64, metadata={"help": "Number of generated arithmetic questions."})


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: First factor.
        b: Second factor.
    """
    return a * b


def correct_answer(completions, product, **kwargs):
    """1.0 when the final assistant message contains the product, else 0.0."""
    return [float(str(target) in completion[-1]["content"]) for completion, target in zip(completions, product)]


def used_tool(completions, **kwargs):
    """0.2 for a completion that called the tool successfully (a tool message without an error)."""
    return [
        0.2 * any(m["role"] == "tool" and not m["content"].startswith('{"error"') for m in completion)
        for completion in completions
    ]


def build_dataset(num_questions: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(num_questions)]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {a} times {b}? Use the tool."}] for a, b in pairs],
            "product": [a * b for a, b in pairs],
        }
    )


def main(script_args: ToolScriptArguments, training_args: GRPOConfig) -> GRPOTrainer:
    model = script_args.model_name_or_path
    if model is None:
        from trl.assets import get_model_path

        model = get_model_path("tiny-Qwen2ForCausalLM")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correct_answer, used_tool],
        args=training_args,
        train_dataset=build_dataset(script_args.num_questions, training_args.seed),
        tools=[multiply],
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    return trainer


if __name__ == "__main__":
    parser = TrlParser((ToolScriptArguments, GRPOConfig))
    script_args, training_args = parser.parse_args_and_config()
    main(script_args, training_args)

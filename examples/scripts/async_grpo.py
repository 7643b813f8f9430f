"""Asynchronous GRPO (AsyncGRPO) example: GSM8K math with an accuracy reward.

Generation runs on a vLLM server beside training: a rollout worker samples and scores completions while the trainer
trains on the finished groups and pushes its weights to the server after every optimizer step. The dataset has
GSM8K's layout (`question`, and `answer` ending in `#### <number>`); the number after `####` is the reference
`solution` that `accuracy_reward` compares the completion's final (boxed) answer with.

Start the server first, on its own device(s), then the trainer. With this project's server (CPU or GPU):

```bash
trl vllm-serve --model Qwen/Qwen3-0.6B --port 8000
accelerate launch examples/scripts/async_grpo.py --model_name_or_path Qwen/Qwen3-0.6B \
    --dataset_name openai/gsm8k --dataset_config main --output_dir async-grpo-gsm8k \
    --vllm_server_base_url http://localhost:8000
```

TRL 1.16's setup, a plain vLLM server with vLLM's weight-transfer engine (GPUs; the trainer on the other ones):

```bash
CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-0.6B --max-model-len 4096 \
    --logprobs-mode processed_logprobs --weight-transfer-config '{"backend":"nccl"}'
CUDA_VISIBLE_DEVICES=1 accelerate launch examples/scripts/async_grpo.py --model_name_or_path Qwen/Qwen3-0.6B \
    --dataset_name openai/gsm8k --dataset_config main --output_dir async-grpo-gsm8k
```

Without `--model_name_or_path` or `--dataset_name` the script runs offline on the embedded tiny model and a few
generated GSM8K-style questions (a random model solves none of them: the run shows the mechanics only). The server
must then serve the tiny model:

```bash
trl vllm-serve --model "$(python -c 'from trl.assets import get_model_path; print(get_model_path("tiny-Qwen2ForCausalLM"))')"
python examples/scripts/async_grpo.py --output_dir async-grpo-example --max_steps 5 --num_generations 4 \
    --per_device_train_batch_size 4 --max_completion_length 16 --token_budget 512
```

Without a reachable server the trainer stops before training with a `ConnectionError`.
"""

import json
from typing import Any

from trl import ModelConfig, ScriptArguments, TrlParser
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.scripts._training import finish_training, load_script_dataset
from trl.trainer.utils import get_peft_config


SYSTEM_PROMPT = "Solve the math problem step by step, then give the final answer as \\boxed{<number>}."


def gsm8k_solution(answer: str) -> str:
    """The reference number of a GSM8K answer: what follows `####`, without thousands separators."""
    return answer.split("####")[-1].strip().replace(",", "")


def to_math_prompt(row: dict[str, Any]) -> dict[str, Any]:
    """A GSM8K row -> a conversational `prompt` and the `solution` column `accuracy_reward` reads."""
    return {
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}],
        "solution": gsm8k_solution(row["answer"]),
    }


def offline_gsm8k(num_questions: int = 16) -> Any:
    """Small additions in GSM8K's layout, so that the offline run goes through the same preprocessing."""
    from datasets import Dataset

    rows = [
        {
            "question": f"Tom has {a} apples and buys {a + 3} more. How many apples does he have?",
            "answer": f"#### {2 * a + 3}",
        }
        for a in range(1, num_questions + 1)
    ]
    return Dataset.from_list(rows)


def load_train_dataset(script_args: ScriptArguments) -> Any:
    """The training split as math prompts (the offline questions when no dataset is given)."""
    if script_args.dataset_name is None:
        dataset = offline_gsm8k()
    else:
        dataset = load_script_dataset(script_args, None)[script_args.dataset_train_split]
    return dataset.map(to_math_prompt, remove_columns=dataset.column_names)


def main(
    script_args: ScriptArguments,
    training_args: AsyncGRPOConfig,
    model_args: ModelConfig,
    trainer_class: type[AsyncGRPOTrainer] = AsyncGRPOTrainer,
) -> AsyncGRPOTrainer:
    """Build the trainer (which connects to the server), train, save.

    Args:
        script_args: Dataset arguments; no `dataset_name` means the offline questions.
        training_args: The AsyncGRPO configuration (server URL, token budget, sampling, staleness).
        model_args: The model id or path, its revision and the optional LoRA settings.
        trainer_class: `AsyncGRPOTrainer`, or a subclass generating elsewhere (as the tests do, in process).

    Returns:
        The trained trainer.
    """
    from trl.rewards import accuracy_reward

    if model_args.model_revision is not None:
        # AsyncGRPO chooses the attention implementation itself and reads `--dtype` from its own config: only the
        # revision is passed on (the config's `model_init_kwargs`, a dict or its JSON text, win).
        init_kwargs = training_args.model_init_kwargs or {}
        if isinstance(init_kwargs, str):
            init_kwargs = json.loads(init_kwargs)
        training_args.model_init_kwargs = {"revision": model_args.model_revision, **init_kwargs}
    trainer = trainer_class(
        model=model_args.model_name_or_path,
        reward_funcs=accuracy_reward,
        args=training_args,
        train_dataset=load_train_dataset(script_args),
        peft_config=get_peft_config(model_args),
    )
    finish_training(trainer, training_args, script_args)
    return trainer


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, AsyncGRPOConfig, ModelConfig]:
    """Parse the command line (or `argv`), filling in the offline tiny model when no model is given."""
    parser = TrlParser((ScriptArguments, AsyncGRPOConfig, ModelConfig))
    script_args, training_args, model_args, _ = parser.parse_args_and_config(args=argv, return_remaining_strings=True)
    if model_args.model_name_or_path is None:
        from trl.assets import get_model_path

        model_args.model_name_or_path = get_model_path("tiny-Qwen2ForCausalLM")
    return script_args, training_args, model_args


if __name__ == "__main__":
    main(*parse_args())

"""GSPO-token example: GRPO with token-level importance weights whose value is the sequence ratio.

Runs offline on the embedded tiny assets when no model or dataset is given (the toy reward favours varied tokens, so
the run shows the mechanics, not a meaningful improvement). GSPO's paper settings are `--beta 0 --epsilon 3e-4
--epsilon_high 4e-4 --loss_type grpo` with several `--steps_per_generation`:

```bash
python examples/scripts/gspo_token.py --output_dir gspo-token-example --max_steps 5 \
    --per_device_train_batch_size 4 --num_generations 4 --max_completion_length 16 --steps_per_generation 2
# with your own model and prompt-only data
python examples/scripts/gspo_token.py --model_name_or_path <model> --dataset_name <dataset> --output_dir gspo-out
```
"""

from datasets import load_dataset

from trl import GRPOConfig, ModelConfig, ScriptArguments, TrlParser
from trl.experimental.gspo_token import GRPOTrainer


def distinct_token_reward(completion_ids, **kwargs):
    """Share of distinct tokens in a completion (a stand-in for a task reward)."""
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    training_args.importance_sampling_level = "sequence_token"
    from trl.assets import get_model_path, load_test_dataset

    model = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
    if script_args.dataset_name is None:
        dataset = load_test_dataset("standard_prompt_only", split="train")
    else:
        dataset = load_dataset(
            script_args.dataset_name, script_args.dataset_config, split=script_args.dataset_train_split
        )
    trainer = GRPOTrainer(model=model, reward_funcs=distinct_token_reward, args=training_args, train_dataset=dataset)
    trainer.train()
    trainer.save_model(training_args.output_dir)

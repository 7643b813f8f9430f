"""GSPO-token example: GRPO with token-level importance weights whose value is the sequence ratio (the script always
sets `importance_sampling_level="sequence_token"`).

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

from trl import GRPOConfig, ModelConfig, ScriptArguments, TrlParser
from trl.experimental.gspo_token import GRPOTrainer
from trl.scripts._training import finish_training, load_script_dataset, split_datasets


def distinct_token_reward(completion_ids, **kwargs):
    """Share of distinct tokens in a completion (a stand-in for a task reward)."""
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    training_args.importance_sampling_level = "sequence_token"
    from trl.assets import get_dataset_path, get_model_path

    model = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
    script_args.dataset_name = script_args.dataset_name or get_dataset_path("standard_prompt_only")
    dataset, _ = split_datasets(load_script_dataset(script_args, None), script_args, training_args)
    trainer = GRPOTrainer(model=model, reward_funcs=distinct_token_reward, args=training_args, train_dataset=dataset)
    finish_training(trainer, training_args, script_args)

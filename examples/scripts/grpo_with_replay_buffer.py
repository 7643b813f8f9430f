"""GRPO with a replay buffer example: groups whose rewards are all equal are replaced by stored groups that varied.

Runs offline on the embedded tiny assets when no model or dataset is given. The toy reward is constant for every
other prompt, so those groups carry no signal and get replaced from the buffer:

```bash
python examples/scripts/grpo_with_replay_buffer.py --output_dir replay-example --max_steps 5 \
    --per_device_train_batch_size 8 --num_generations 4 --max_completion_length 16 --replay_buffer_size 16
# with your own model and prompt-only data
python examples/scripts/grpo_with_replay_buffer.py --model_name_or_path <model> --dataset_name <dataset> \
    --replay_buffer_size 64 --output_dir replay-out
```
"""

from trl import ModelConfig, ScriptArguments, TrlParser
from trl.experimental.grpo_with_replay_buffer import GRPOWithReplayBufferConfig, GRPOWithReplayBufferTrainer
from trl.scripts._training import finish_training, load_script_dataset, split_datasets


def sometimes_constant_reward(prompts, completion_ids, **kwargs):
    """1.0 for prompts of odd length whatever the completion (no signal); otherwise the share of distinct tokens."""
    return [
        1.0 if len(str(prompt)) % 2 else len(set(ids)) / max(len(ids), 1)
        for prompt, ids in zip(prompts, completion_ids)
    ]


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOWithReplayBufferConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    from trl.assets import get_dataset_path, get_model_path

    model = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
    script_args.dataset_name = script_args.dataset_name or get_dataset_path("standard_prompt_only")
    dataset, _ = split_datasets(load_script_dataset(script_args, None), script_args, training_args)
    trainer = GRPOWithReplayBufferTrainer(
        model=model, reward_funcs=sometimes_constant_reward, args=training_args, train_dataset=dataset
    )
    finish_training(trainer, training_args, script_args)

"""GFPO (Group Filtered Policy Optimization) example: sample `num_generations` completions per prompt, train on the
`num_remains_in_group` shortest of each group.

Runs offline on the embedded tiny assets when no model or dataset is given (the toy reward favours varied tokens, so
the run shows the mechanics, not a meaningful improvement):

```bash
python examples/scripts/gfpo.py --output_dir gfpo-example --max_steps 5 --per_device_train_batch_size 8 \
    --num_generations 8 --num_remains_in_group 4 --max_completion_length 16
# with your own model and prompt-only data
python examples/scripts/gfpo.py --model_name_or_path <model> --dataset_name <prompt-only dataset> \
    --num_generations 16 --num_remains_in_group 8 --output_dir gfpo-out
```
"""

from trl import ModelConfig, ScriptArguments, TrlParser
from trl.experimental.gfpo import GFPOConfig, GFPOTrainer
from trl.scripts._training import finish_training, load_script_dataset, split_datasets


def distinct_token_reward(completion_ids, **kwargs):
    """Share of distinct tokens in a completion (a stand-in for a task reward)."""
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


def shortest_completions(group_completions, group_rewards, **kwargs):
    """GFPO's length filter: the shorter a completion, the higher its score (so the shortest are kept)."""
    return [[-float(len(completion)) for completion in completions] for completions in group_completions]


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GFPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    if training_args.num_remains_in_group is None:
        training_args.num_remains_in_group = max(2, training_args.num_generations // 2)
    from trl.assets import get_dataset_path, get_model_path

    model = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
    script_args.dataset_name = script_args.dataset_name or get_dataset_path("standard_prompt_only")
    dataset, _ = split_datasets(load_script_dataset(script_args, None), script_args, training_args)
    trainer = GFPOTrainer(
        model=model,
        reward_funcs=distinct_token_reward,
        args=training_args,
        train_dataset=dataset,
        group_filter_func=shortest_completions,
    )
    finish_training(trainer, training_args, script_args)

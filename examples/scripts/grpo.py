"""GRPO example.

Runs offline on the embedded tiny assets when no model, dataset or reward is given (a tiny random reward model scores
the completions, so the run shows the mechanics, not a meaningful improvement):

```bash
python examples/scripts/grpo.py --output_dir grpo-example --max_steps 5 --per_device_train_batch_size 4 \
    --num_generations 4 --max_completion_length 16
accelerate launch examples/scripts/grpo.py --output_dir grpo-example --max_steps 5
# with your own model, data and rewards
python examples/scripts/grpo.py --model_name_or_path <model> --dataset_name <prompt-only dataset> \
    --reward_funcs think_format_reward my_rewards.correctness --output_dir grpo-out --use_peft
```
"""

from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser
from trl.scripts.grpo import GRPOScriptArguments, main


if __name__ == "__main__":
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if model_args.model_name_or_path is None or (script_args.dataset_name is None and not dataset_args.datasets):
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("standard_prompt_only")
    if script_args.reward_model_name_or_path is None and not script_args.reward_funcs:
        from trl.assets import get_model_path

        script_args.reward_model_name_or_path = get_model_path("tiny-Qwen2ForSequenceClassification")
    main(script_args, training_args, model_args, dataset_args)

"""PPO on TL;DR summarisation with the experimental `PPOTrainer` (prompts longer than 512 tokens are dropped).

Runs offline on the embedded tiny assets when no model or dataset is given:

```bash
python examples/scripts/ppo/ppo_tldr.py --output_dir ppo-tldr-example --total_episodes 64 --response_length 16
# the setup of "The N+ Implementation Details of RLHF with PPO" (hub dataset and models)
python examples/scripts/ppo/ppo_tldr.py --dataset_name trl-lib/tldr --dataset_test_split validation \
    --learning_rate 3e-6 --output_dir pythia-1b-deduped-tldr-ppo --per_device_train_batch_size 16 \
    --gradient_accumulation_steps 4 --total_episodes 1000000 --model_name_or_path EleutherAI/pythia-1b-deduped \
    --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr \
    --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr \
    --missing_eos_penalty 1.0 --stop_token eos --response_length 53
```
"""

from trl import ModelConfig, ScriptArguments, TrlParser


# Longest prompt kept, in tokens (TL;DR posts beyond it are rare and would dominate memory).
MAX_PROMPT_TOKENS = 512


if __name__ == "__main__":
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.ppo import PPOConfig
    from trl.scripts._ppo import run_ppo

    parser = TrlParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    run_ppo(script_args, training_args, model_args, keep_row=lambda row, length: length <= MAX_PROMPT_TOKENS)

"""PPO example with the experimental `PPOTrainer`: a policy, a reward model and a value model.

Runs offline on the embedded tiny assets when no model or dataset is given:

```bash
python examples/scripts/ppo/ppo.py --output_dir ppo-example --total_episodes 64 --response_length 16
# the descriptiveness task of TRL's docs (a hub dataset and models)
python examples/scripts/ppo/ppo.py \
    --dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style --dataset_train_split descriptiveness \
    --learning_rate 3e-6 --output_dir pythia-1b-deduped-descriptiveness --per_device_train_batch_size 64 \
    --gradient_accumulation_steps 1 --total_episodes 10000 --model_name_or_path EleutherAI/pythia-1b-deduped \
    --sft_model_path EleutherAI/pythia-1b-deduped --reward_model_path EleutherAI/pythia-1b-deduped \
    --missing_eos_penalty 1.0
```

The dataset needs a `prompt` column (text or conversation); prompts are tokenized (left-padded at collation).
"""

from trl import ModelConfig, ScriptArguments, TrlParser


if __name__ == "__main__":
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.ppo import PPOConfig
    from trl.scripts._ppo import run_ppo

    parser = TrlParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    run_ppo(script_args, training_args, model_args)

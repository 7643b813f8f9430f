"""Outcome reward model (ORM) training example with `RewardTrainer`.

Runs offline on the embedded tiny assets when no model or dataset is given:

```bash
python examples/scripts/reward_modeling.py --output_dir reward-example --max_steps 20
accelerate launch examples/scripts/reward_modeling.py --output_dir reward-example --max_steps 20
# with your own model and preference data (chosen/rejected, optional prompt and margin columns)
python examples/scripts/reward_modeling.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> \
    --output_dir reward-out --max_length 2048 --use_peft --lora_r 16 --lora_alpha 32
```

A causal-LM checkpoint is fine: it is loaded with `AutoModelForSequenceClassification` and gets a fresh `score` head
(trained, and saved with the adapter when PEFT is used).
"""

from trl import DatasetMixtureConfig, ModelConfig, RewardConfig, ScriptArguments, TrlParser
from trl.scripts.reward import main


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, RewardConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if model_args.model_name_or_path is None or (script_args.dataset_name is None and not dataset_args.datasets):
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path(
            "tiny-Qwen2ForSequenceClassification"
        )
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("conversational_preference")
    main(script_args, training_args, model_args, dataset_args)

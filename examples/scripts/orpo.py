"""Odds Ratio Preference Optimization (ORPO) example.

No reference model is loaded: the method is reference-free. Runs offline on the embedded tiny assets when no model or
dataset is given:

```bash
python examples/scripts/orpo.py --output_dir orpo-example --max_steps 20
accelerate launch examples/scripts/orpo.py --output_dir orpo-example --max_steps 20
# with your own model and data, and LoRA
python examples/scripts/orpo.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> \
    --output_dir orpo-out --beta 0.1 --use_peft --lora_r 16
```
"""

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from trl.experimental.orpo import ORPOConfig, ORPOTrainer
from trl.scripts._training import train_with_trainer


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, ORPOConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if model_args.model_name_or_path is None or (script_args.dataset_name is None and not dataset_args.datasets):
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("conversational_preference")
    train_with_trainer(ORPOTrainer, script_args, training_args, model_args, dataset_args)

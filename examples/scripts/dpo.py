"""Direct Preference Optimization example.

Runs offline on the embedded tiny assets when no model or dataset is given:

```bash
python examples/scripts/dpo.py --output_dir dpo-example --max_steps 20
accelerate launch examples/scripts/dpo.py --output_dir dpo-example --max_steps 20
# with your own model and data, LoRA, and the reference log-probs computed once before training
python examples/scripts/dpo.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> \
    --output_dir dpo-out --use_peft --lora_r 16 --precompute_ref_log_probs
```
"""

from trl import DatasetMixtureConfig, DPOConfig, ModelConfig, ScriptArguments, TrlParser
from trl.scripts.dpo import main


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, DPOConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if model_args.model_name_or_path is None or (script_args.dataset_name is None and not dataset_args.datasets):
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("conversational_preference")
    main(script_args, training_args, model_args, dataset_args)

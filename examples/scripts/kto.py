"""Kahneman-Tversky Optimization example.

Runs offline on the embedded tiny assets when no model or dataset is given:

```bash
python examples/scripts/kto.py --output_dir kto-example --max_steps 20
accelerate launch examples/scripts/kto.py --output_dir kto-example --max_steps 20
# with your own model and (un)paired preference data, LoRA, and the reference log-probs computed once before training
python examples/scripts/kto.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> \
    --output_dir kto-out --use_peft --lora_r 16 --precompute_ref_log_probs
```
"""

from trl import DatasetMixtureConfig, KTOConfig, ModelConfig, ScriptArguments, TrlParser
from trl.scripts.kto import main


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, KTOConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if model_args.model_name_or_path is None or (script_args.dataset_name is None and not dataset_args.datasets):
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("conversational_unpaired_preference")
    main(script_args, training_args, model_args, dataset_args)

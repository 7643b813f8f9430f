"""Supervised fine-tuning example.

Runs offline on the embedded tiny assets when no model or dataset is given:

```bash
python examples/scripts/sft.py --output_dir sft-example --max_steps 20
accelerate launch examples/scripts/sft.py --output_dir sft-example --max_steps 20
# with your own model and data
python examples/scripts/sft.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> \
    --output_dir sft-out --packing --use_peft --lora_r 16
```
"""

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser
from trl.scripts.sft import main


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if model_args.model_name_or_path is None or (script_args.dataset_name is None and not dataset_args.datasets):
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("conversational_prompt_completion")
    main(script_args, training_args, model_args, dataset_args)

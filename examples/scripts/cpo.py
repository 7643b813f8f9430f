"""Contrastive Preference Optimization (CPO) example, with its SimPO and AlphaPO variants.

No reference model is loaded: the method is reference-free. Runs offline on the embedded tiny assets when no model or
dataset is given:

```bash
python examples/scripts/cpo.py --output_dir cpo-example --max_steps 20
accelerate launch examples/scripts/cpo.py --output_dir cpo-example --max_steps 20
# SimPO (no NLL term), AlphaPO (reward shape alpha), LoRA
python examples/scripts/cpo.py --model_name_or_path <model dir or id> --dataset_name <dataset dir or id> \
    --output_dir simpo-out --loss_type simpo --cpo_alpha 0 --beta 2.0 --simpo_gamma 0.5
python examples/scripts/cpo.py ... --loss_type alphapo --alpha 0.25 --use_peft --lora_r 16
```
"""

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.scripts._training import train_with_trainer


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, CPOConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if model_args.model_name_or_path is None or (script_args.dataset_name is None and not dataset_args.datasets):
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("conversational_preference")
    train_with_trainer(CPOTrainer, script_args, training_args, model_args, dataset_args)

"""Generalized Knowledge Distillation (GKD) example: a small student learns a teacher's next-token distributions.

Runs offline on the embedded tiny assets when no model, teacher or dataset is given (the tiny Qwen2 student, the
small Qwen2 teacher, which shares its tokenizer, and the offline conversations):

```bash
python examples/scripts/gkd.py --output_dir gkd-example --max_steps 20 --max_new_tokens 32
accelerate launch examples/scripts/gkd.py --output_dir gkd-example --max_steps 20
# with your own student, teacher and conversations (`messages` column)
python examples/scripts/gkd.py --model_name_or_path <student> --teacher_model_name_or_path <teacher> \
    --dataset_name <dataset dir or id> --output_dir gkd-out --lmbda 0.5 --beta 0.5 --use_peft --lora_r 16
```
"""

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from trl.experimental.gkd import GKDConfig, GKDTrainer
from trl.scripts._training import train_with_trainer


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GKDConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if (
        model_args.model_name_or_path is None
        or training_args.teacher_model_name_or_path is None
        or (script_args.dataset_name is None and not dataset_args.datasets)
    ):
        from trl.assets import get_dataset_path, get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        if training_args.teacher_model_name_or_path is None:
            training_args.teacher_model_name_or_path = get_model_path("small-Qwen2ForCausalLM")
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("conversational_language_modeling")
    train_with_trainer(GKDTrainer, script_args, training_args, model_args, dataset_args)

"""GOLD example: a small student distilled from a teacher whose tokenizer differs (Universal Logit Distillation).

Runs offline on the embedded tiny assets when no model, teacher or dataset is given (the tiny Qwen2 student, the tiny
Llama teacher, which has its own Llama-3-style tokenizer, and the offline conversations); the cross-tokenizer loss is
then switched on, since the two tokenizers differ:

```bash
python examples/scripts/gold.py --output_dir gold-example --max_steps 20 --max_completion_length 32
accelerate launch examples/scripts/gold.py --output_dir gold-example --max_steps 20
# with your own student, teacher and conversations (`messages` column)
python examples/scripts/gold.py --model_name_or_path <student> --teacher_model_name_or_path <teacher> \
    --dataset_name <dataset dir or id> --output_dir gold-out --use_uld_loss --uld_use_hybrid_loss --lmbda 0.5
```
"""

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from trl.experimental.gold import GOLDConfig, GOLDTrainer
from trl.scripts._training import train_with_trainer


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GOLDConfig, ModelConfig, DatasetMixtureConfig))
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
            training_args.teacher_model_name_or_path = get_model_path("tiny-LlamaForCausalLM")
            training_args.use_uld_loss = True  # the tiny Llama teacher has another tokenizer
        if script_args.dataset_name is None and not dataset_args.datasets:
            script_args.dataset_name = get_dataset_path("conversational_language_modeling")
    train_with_trainer(GOLDTrainer, script_args, training_args, model_args, dataset_args)

"""On-policy distillation example.

Runs offline on the embedded tiny assets when no model, teacher or dataset is given (the 2-layer tiny-Qwen2 student
learns from the 8-layer small-Qwen2 teacher, both random-weight, so the run shows the mechanics):

```bash
python examples/scripts/distillation.py --output_dir distillation-example --max_steps 5 \
    --per_device_train_batch_size 4 --max_completion_length 16
accelerate launch examples/scripts/distillation.py --output_dir distillation-example --max_steps 5
# with your own student, teacher and prompts (the teacher must share the student's vocabulary)
python examples/scripts/distillation.py --model_name_or_path <student> --teacher_model_name_or_path <teacher> \
    --dataset_name <prompt-only dataset> --beta 0.5 --output_dir distillation-out --use_peft
```
"""

from trl import DatasetMixtureConfig, DistillationConfig, ModelConfig, ScriptArguments, TrlParser
from trl.scripts.distillation import main


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, DistillationConfig, ModelConfig, DatasetMixtureConfig))
    script_args, training_args, model_args, dataset_args, _ = parser.parse_args_and_config(
        return_remaining_strings=True
    )
    if model_args.model_name_or_path is None or training_args.teacher_model_name_or_path is None:
        from trl.assets import get_model_path

        model_args.model_name_or_path = model_args.model_name_or_path or get_model_path("tiny-Qwen2ForCausalLM")
        training_args.teacher_model_name_or_path = training_args.teacher_model_name_or_path or get_model_path(
            "small-Qwen2ForCausalLM"
        )
    if script_args.dataset_name is None and not dataset_args.datasets:
        from trl.assets import get_dataset_path

        script_args.dataset_name = get_dataset_path("standard_prompt_only")
    main(script_args, training_args, model_args, dataset_args)

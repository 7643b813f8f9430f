"""Online DPO example.

Runs offline on the embedded tiny assets when no model, dataset or ranking is given (a tiny random reward model scores
the completions, so the run shows the mechanics, not a meaningful improvement):

```bash
python examples/scripts/online_dpo.py --output_dir online-dpo-example --max_steps 5 --per_device_train_batch_size 2 \
    --max_new_tokens 16
accelerate launch examples/scripts/online_dpo.py --output_dir online-dpo-example --max_steps 5
# with your own model, prompts and reward model (same tokenizer/chat template as the policy), LoRA
python examples/scripts/online_dpo.py --model_name_or_path <model> --dataset_name <prompt-only dataset> \
    --reward_model_path <sequence-classification model> --missing_eos_penalty 1.0 --output_dir online-dpo-out \
    --use_peft
# or rank the pairs with a judge (pair_rm needs llm-blender, openai needs OPENAI_API_KEY, hf an inference token)
python examples/scripts/online_dpo.py --model_name_or_path <model> --dataset_name <prompt-only dataset> \
    --judge pair_rm --output_dir online-dpo-out
```

The arguments are those of the config plus `--judge`; see `trl/scripts/_online_preference.py`.
"""

from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from trl.scripts._online_preference import run_online_preference_script


if __name__ == "__main__":
    run_online_preference_script(OnlineDPOTrainer, OnlineDPOConfig)

"""DDPO (Denoising Diffusion Policy Optimization) example: fine-tune a Stable Diffusion pipeline on an image reward.

Runs offline on the embedded tiny pipeline (random weights, 32x32 images) when no model is given, with a reward
that needs no download (image brightness, or closeness of the mean colour to red, green or blue):

```bash
python examples/scripts/ddpo.py --output_dir ddpo-example --num_epochs 20 --mixed_precision no
# a real pipeline (diffusers layout, local directory or hub id), rewarding red images, logging to TensorBoard
python examples/scripts/ddpo.py --pretrained_model <pipeline dir or id> --reward red --output_dir ddpo-out \\
    --sample_num_steps 50 --sample_batch_size 6 --train_batch_size 3 --log_with tensorboard
```

Sampled images go to the configured trackers (`--log_with`) once per epoch; the LoRA weights are saved to
`--output_dir` (loadable with diffusers' `pipeline.load_lora_weights(output_dir)`).
"""

from trl import TrlParser
from trl.scripts._diffusion import DiffusionScriptArguments, run_diffusion_example


if __name__ == "__main__":
    from trl.experimental.ddpo import DDPOConfig, DDPOTrainer

    parser = TrlParser((DiffusionScriptArguments, DDPOConfig))
    script_args, config = parser.parse_args_and_config()
    run_diffusion_example(DDPOTrainer, script_args, config)

"""AlignProp (reward backpropagation) example: fine-tune a Stable Diffusion pipeline on a differentiable reward.

Runs offline on the embedded tiny pipeline (random weights, 32x32 images) when no model is given, with a reward
that needs no download (image brightness, or closeness of the mean colour to red, green or blue):

```bash
python examples/scripts/alignprop.py --output_dir alignprop-example --num_epochs 20 --mixed_precision no
# a real pipeline, gradients through the last 10 of 50 denoising steps, logging to TensorBoard
python examples/scripts/alignprop.py --pretrained_model <pipeline dir or id> --reward blue \\
    --truncated_backprop_rand false --truncated_backprop_timestep 40 --log_with tensorboard
```

Sampled images go to the configured trackers every `--log_image_freq` steps; the LoRA weights are saved to
`--output_dir`.
"""

from trl import TrlParser
from trl.scripts._diffusion import DiffusionScriptArguments, run_diffusion_example


if __name__ == "__main__":
    from trl.experimental.alignprop import AlignPropConfig, AlignPropTrainer

    parser = TrlParser((DiffusionScriptArguments, AlignPropConfig))
    script_args, config = parser.parse_args_and_config()
    run_diffusion_example(AlignPropTrainer, script_args, config)

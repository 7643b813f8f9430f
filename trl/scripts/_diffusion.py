"""What the DDPO and AlignProp example scripts share: their options, prompts, the reward by name, the run."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ._training import release_process_group


EXAMPLE_PROMPTS = ["a cat", "a dog", "a horse", "a bird", "a fish", "a rabbit"]
_COLOURS = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0)}


@dataclass
class DiffusionScriptArguments:
    """Options of the diffusion example scripts besides the trainer's config."""

    pretrained_model: str | None = field(
        default=None, metadata={"help": "Stable Diffusion pipeline (diffusers layout); default: the tiny offline one."}
    )
    pretrained_revision: str = field(default="main", metadata={"help": "Hub revision of the pipeline."})
    use_lora: bool = field(default=True, metadata={"help": "Train a LoRA adapter instead of the whole UNet."})
    reward: str = field(default="brightness", metadata={"help": "'brightness', 'red', 'green' or 'blue'."})
    output_dir: str = field(default="diffusion-output", metadata={"help": "Where the trained weights are saved."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repository for `--push_to_hub`."})


def image_reward(name: str):
    """The example reward called `name`: image brightness, or closeness of the mean colour to red/green/blue."""
    from ..rewards import get_color_target_reward, image_brightness_reward

    if name == "brightness":
        return image_brightness_reward
    if name not in _COLOURS:
        raise ValueError(f"--reward must be 'brightness' or one of {sorted(_COLOURS)}, got {name!r}.")
    return get_color_target_reward(_COLOURS[name])


def run_diffusion_example(trainer_cls, script_args: DiffusionScriptArguments, config) -> None:
    """Build the pipeline, train with random example prompts and the chosen reward, save (and push) the weights."""
    from ..assets import get_diffusion_pipeline_path
    from ..models import DefaultDDPOStableDiffusionPipeline

    pipeline = DefaultDDPOStableDiffusionPipeline(
        script_args.pretrained_model or get_diffusion_pipeline_path(),
        pretrained_model_revision=script_args.pretrained_revision,
        use_lora=script_args.use_lora,
    )
    prompt_rng = random.Random(config.seed)
    trainer = trainer_cls(
        config, image_reward(script_args.reward), lambda: (prompt_rng.choice(EXAMPLE_PROMPTS), {}), pipeline
    )
    trainer.train()
    trainer.save_pretrained(script_args.output_dir)
    if config.push_to_hub:
        if not script_args.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id <user/repo>.")
        trainer.push_to_hub(script_args.hub_model_id, folder=script_args.output_dir)
    release_process_group()

"""Helpers of the diffusion trainer tests (DDPO, AlignProp): the tiny pipeline, a recording tracker, evaluation."""

import itertools

import torch
from accelerate.tracking import GeneralTracker

from trl.assets import get_diffusion_pipeline_path


PROMPTS = ["a red cat", "a blue dog"]


def cycling_prompt_fn():
    """A prompt function returning the two test prompts in turn, with their index as metadata."""
    counter = itertools.count()

    def prompt_fn():
        i = next(counter) % len(PROMPTS)
        return PROMPTS[i], {"index": i}

    return prompt_fn


def tiny_pipeline(use_lora=True):
    from trl.models import DefaultDDPOStableDiffusionPipeline

    pipeline = DefaultDDPOStableDiffusionPipeline(get_diffusion_pipeline_path(), use_lora=use_lora)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.get_trainable_layers()  # adds the LoRA adapter now, so tests can snapshot it before training
    return pipeline


def trainable_snapshot(pipeline):
    return {name: p.detach().clone() for name, p in pipeline.unet.named_parameters() if p.requires_grad}


def mean_brightness(pipeline, num_steps=4):
    """Brightness of 16 images from fixed latents and fixed step noise: training changes it, sampling noise cannot."""
    generator = torch.Generator().manual_seed(123)
    latents = torch.randn(16, 4, 4, 4, generator=generator)
    output = pipeline(
        PROMPTS * 8,
        num_inference_steps=num_steps,
        guidance_scale=5.0,
        eta=1.0,
        output_type="pt",
        latents=latents,
        generator=generator,
    )
    return output.images.mean().item()


class RecordingTracker(GeneralTracker):
    """An accelerate tracker that keeps what it is given: `logs` (step, values), `images` (step, values), `config`."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.logs, self.images, self.config = [], [], None

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values):
        self.config = values

    def log(self, values, step=None, **kwargs):
        self.logs.append((step, dict(values)))

    def log_images(self, values, step=None, **kwargs):
        self.images.append((step, dict(values)))

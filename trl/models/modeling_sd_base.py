"""Stable Diffusion pipelines for reinforcement learning (DDPO, AlignProp), built on `diffusers`.

The trainers need two things a plain `StableDiffusionPipeline` does not give: every intermediate latent of the
denoising chain, and the log-probability of each DDIM step under the current UNet. `DDPOStableDiffusionPipeline` is
the interface the trainers talk to (pipeline and scheduler fused in one object); `DefaultDDPOStableDiffusionPipeline`
implements it around a diffusers pipeline, optionally with a LoRA adapter (peft) on the UNet.

A DDIM step with `eta > 0` samples `x_{t-1} ~ N(mu_t(x_t, eps), sigma_t^2 I)`; `scheduler_step` returns the sample
and `log N(x_{t-1}; mu_t, sigma_t^2 I)` averaged over the latent's elements, the policy log-probability DDPO's
importance ratio is built from.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class DDPOPipelineOutput:
    """What a sampling run returns.

    Args:
        images (`torch.Tensor`):
            The decoded images, `(batch, 3, height, width)` in `[0, 1]` for `output_type="pt"`.
        latents (`list[torch.Tensor]`):
            The latents of the chain, the initial noise first: `num_inference_steps + 1` tensors.
        log_probs (`list[torch.Tensor]`):
            The log-probability of each step's sample, one `(batch,)` tensor per step.
    """

    images: torch.Tensor
    latents: list[torch.Tensor]
    log_probs: list[torch.Tensor]


@dataclass
class DDPOSchedulerOutput:
    """One DDIM step: the next latent and its log-probability under the step's Gaussian.

    Args:
        latents (`torch.Tensor`):
            `x_{t-1}`, shaped like the input sample.
        log_probs (`torch.Tensor`):
            `(batch,)` mean over the latent's elements of the Gaussian log-density of `x_{t-1}`.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor


class DDPOStableDiffusionPipeline:
    """Interface between the diffusion trainers and a Stable Diffusion pipeline with its scheduler.

    Implementations sample with per-step log-probabilities (`__call__`), sample with gradients through the UNet
    (`rgb_with_grad`, for AlignProp), take one scheduler step with its log-probability (`scheduler_step`), expose
    the pipeline's components, and save/load what is trained.
    """

    def __call__(self, *args, **kwargs) -> DDPOPipelineOutput:
        """Sample images, returning every latent and every step's log-probability."""
        raise NotImplementedError

    def rgb_with_grad(self, *args, **kwargs) -> DDPOPipelineOutput:
        """Sample images keeping the autograd graph through (some of) the denoising steps."""
        raise NotImplementedError

    def scheduler_step(self, *args, **kwargs) -> DDPOSchedulerOutput:
        """One scheduler step returning the next latent and its log-probability."""
        raise NotImplementedError

    @property
    def unet(self):
        """The denoising UNet."""
        raise NotImplementedError

    @property
    def vae(self):
        """The autoencoder that decodes latents to images."""
        raise NotImplementedError

    @property
    def tokenizer(self):
        """The text tokenizer."""
        raise NotImplementedError

    @property
    def scheduler(self):
        """The (DDIM) noise scheduler."""
        raise NotImplementedError

    @property
    def text_encoder(self):
        """The text encoder producing the prompt embeddings."""
        raise NotImplementedError

    @property
    def autocast(self):
        """A context manager for the forward passes (mixed precision), or a null context."""
        raise NotImplementedError

    def set_progress_bar_config(self, *args, **kwargs):
        """Configure the sampling progress bar."""
        raise NotImplementedError

    def save_pretrained(self, *args, **kwargs):
        """Save what is trained (LoRA weights or the full pipeline)."""
        raise NotImplementedError

    def get_trainable_layers(self, *args, **kwargs):
        """The trainable module (or parameters) handed to the optimizer."""
        raise NotImplementedError

    def save_checkpoint(self, *args, **kwargs):
        """Accelerate's save-state hook: write the trained weights into a checkpoint directory."""
        raise NotImplementedError

    def load_checkpoint(self, *args, **kwargs):
        """Accelerate's load-state hook: read the trained weights back from a checkpoint directory."""
        raise NotImplementedError


def _left_broadcast(values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reshape `values` (scalar or `(batch,)`) to broadcast against a tensor of `shape` from the left."""
    extra = len(shape) - values.ndim
    return values.reshape(values.shape + (1,) * extra).broadcast_to(shape)


def _alphas_cumprod_at(scheduler, timesteps: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`alpha_bar_t` for each timestep, `final_alpha_cumprod` where the timestep is negative (past the last step)."""
    alphas_cumprod = scheduler.alphas_cumprod.to(device=timesteps.device, dtype=dtype)
    gathered = torch.gather(alphas_cumprod, 0, timesteps.clamp(min=0).long())
    final = torch.as_tensor(scheduler.final_alpha_cumprod, dtype=alphas_cumprod.dtype, device=timesteps.device)
    return torch.where(timesteps >= 0, gathered, final)


def ddim_variance(
    scheduler, timestep: torch.Tensor, prev_timestep: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """DDIM's `sigma_t^2 / eta^2 = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)` with `a = alpha_bar`."""
    alpha_prod_t = _alphas_cumprod_at(scheduler, timestep, dtype)
    alpha_prod_t_prev = _alphas_cumprod_at(scheduler, prev_timestep, dtype)
    return (1 - alpha_prod_t_prev) / (1 - alpha_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)


def scheduler_step(
    self,
    model_output: torch.FloatTensor,
    timestep: int | torch.Tensor,
    sample: torch.FloatTensor,
    eta: float = 0.0,
    use_clipped_model_output: bool = False,
    generator: torch.Generator | None = None,
    prev_sample: torch.FloatTensor | None = None,
) -> DDPOSchedulerOutput:
    """One DDIM step that also returns the log-probability of the next latent.

    Follows the DDIM update (Song et al., eq. 12): predict `x_0` from the model output, then
    `x_{t-1} = sqrt(a_prev) x_0 + sqrt(1 - a_prev - sigma_t^2) eps + sigma_t z` with `sigma_t = eta * sqrt(variance)`.

    Args:
        self (`diffusers.DDIMScheduler`):
            The scheduler (its `alphas_cumprod`, `num_inference_steps` and `config`), passed explicitly.
        model_output (`torch.FloatTensor`):
            The UNet's output at `sample`.
        timestep (`int` or `torch.Tensor`):
            The current timestep, a scalar or one per batch element.
        sample (`torch.FloatTensor`):
            `x_t`.
        eta (`float`, *optional*, defaults to `0.0`):
            Weight of the noise; `0` is the deterministic DDIM sampler, `1` is DDPM-like.
        use_clipped_model_output (`bool`, *optional*, defaults to `False`):
            Recompute `eps` from the clipped/thresholded `x_0` prediction.
        generator (`torch.Generator`, *optional*):
            Generator for the noise `z`.
        prev_sample (`torch.FloatTensor`, *optional*):
            A given `x_{t-1}` to score instead of drawing one (DDPO's training pass).

    Returns:
        [`DDPOSchedulerOutput`]: `x_{t-1}` and its per-example log-probability (mean over elements).
    """
    if self.num_inference_steps is None:
        raise ValueError("The scheduler has no timesteps yet: call `scheduler.set_timesteps(num_steps)` first.")
    if eta > 0 and prev_sample is not None and generator is not None:
        raise ValueError("Pass either `generator` (to draw x_{t-1}) or `prev_sample` (to score it), not both.")

    timestep = torch.as_tensor(timestep, device=sample.device)
    prev_timestep = timestep - self.config.num_train_timesteps // self.num_inference_steps
    prev_timestep = prev_timestep.clamp(min=-1, max=self.config.num_train_timesteps - 1)
    # Schedule terms in at least float32 (1 - a_t / a_prev cancels badly in half precision).
    dtype = torch.promote_types(sample.dtype, torch.float32)
    alpha_prod_t = _left_broadcast(_alphas_cumprod_at(self, timestep, dtype), sample.shape).to(sample.dtype)
    alpha_prod_t_prev = _left_broadcast(_alphas_cumprod_at(self, prev_timestep, dtype), sample.shape).to(sample.dtype)
    beta_prod_t = 1 - alpha_prod_t

    prediction_type = self.config.prediction_type
    if prediction_type == "epsilon":
        pred_original_sample = (sample - beta_prod_t.sqrt() * model_output) / alpha_prod_t.sqrt()
        pred_epsilon = model_output
    elif prediction_type == "sample":
        pred_original_sample = model_output
        pred_epsilon = (sample - alpha_prod_t.sqrt() * pred_original_sample) / beta_prod_t.sqrt()
    elif prediction_type == "v_prediction":
        pred_original_sample = alpha_prod_t.sqrt() * sample - beta_prod_t.sqrt() * model_output
        pred_epsilon = alpha_prod_t.sqrt() * model_output + beta_prod_t.sqrt() * sample
    else:
        raise ValueError(
            f"Unsupported prediction_type {prediction_type!r}: expected 'epsilon', 'sample' or 'v_prediction'."
        )

    if self.config.thresholding:
        pred_original_sample = self._threshold_sample(pred_original_sample)
    elif self.config.clip_sample:
        limit = self.config.clip_sample_range
        pred_original_sample = pred_original_sample.clamp(-limit, limit)

    variance = _left_broadcast(ddim_variance(self, timestep, prev_timestep, dtype), sample.shape).to(sample.dtype)
    std_dev_t = eta * variance.sqrt()
    if use_clipped_model_output:
        pred_epsilon = (sample - alpha_prod_t.sqrt() * pred_original_sample) / beta_prod_t.sqrt()

    direction = (1 - alpha_prod_t_prev - std_dev_t**2).clamp(min=0).sqrt() * pred_epsilon
    prev_sample_mean = alpha_prod_t_prev.sqrt() * pred_original_sample + direction

    if prev_sample is None:
        from diffusers.utils.torch_utils import randn_tensor

        # diffusers' own draw, as its schedulers' `step` makes it: on the generator's device (the output's without
        # one), so a CUDA generator works and the noise comes from the same random stream as diffusers'.
        noise = randn_tensor(
            model_output.shape, generator=generator, device=model_output.device, dtype=model_output.dtype
        )
        prev_sample = prev_sample_mean + std_dev_t * noise

    # Gaussian log-density of x_{t-1}; the sample is a constant (only the mean carries the policy's gradient).
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * std_dev_t**2)
        - torch.log(std_dev_t)
        - math.log(math.sqrt(2 * math.pi))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return DDPOSchedulerOutput(prev_sample.type(sample.dtype), log_prob)


def _encode_prompts(pipeline, prompt, device, num_images_per_prompt, guidance, negative_prompt, embeds, negative):
    prompt_embeds, negative_embeds = pipeline.encode_prompt(
        prompt,
        device,
        num_images_per_prompt,
        guidance,
        negative_prompt,
        prompt_embeds=embeds,
        negative_prompt_embeds=negative,
    )
    # One UNet call per step over [unconditional, conditional] when guiding.
    return torch.cat([negative_embeds, prompt_embeds]) if guidance else prompt_embeds


def _denoise(
    pipeline,
    *,
    prompt,
    height,
    width,
    num_inference_steps,
    guidance_scale,
    negative_prompt,
    num_images_per_prompt,
    eta,
    generator,
    latents,
    prompt_embeds,
    negative_prompt_embeds,
    cross_attention_kwargs,
    guidance_rescale,
    callback,
    callback_steps,
    keep_grad: Callable[[int], bool] | None,
    gradient_checkpoint: bool = False,
):
    """The shared sampling loop; `keep_grad(i)` says whether step `i`'s UNet output stays in the autograd graph."""
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

    height = height or pipeline.unet.config.sample_size * pipeline.vae_scale_factor
    width = width or pipeline.unet.config.sample_size * pipeline.vae_scale_factor
    pipeline.check_inputs(
        prompt, height, width, callback_steps, negative_prompt, prompt_embeds, negative_prompt_embeds
    )
    if prompt is not None:
        batch_size = 1 if isinstance(prompt, str) else len(prompt)
    else:
        batch_size = prompt_embeds.shape[0]
    device = pipeline._execution_device
    guidance = guidance_scale > 1.0
    embeds = _encode_prompts(
        pipeline,
        prompt,
        device,
        num_images_per_prompt,
        guidance,
        negative_prompt,
        prompt_embeds,
        negative_prompt_embeds,
    )

    pipeline.scheduler.set_timesteps(num_inference_steps, device=device)
    timesteps = pipeline.scheduler.timesteps
    latents = pipeline.prepare_latents(
        batch_size * num_images_per_prompt,
        pipeline.unet.config.in_channels,
        height,
        width,
        embeds.dtype,
        device,
        generator,
        latents,
    )
    all_latents, all_log_probs = [latents], []

    def unet_forward(model_input, t, encoder_hidden_states):
        return pipeline.unet(
            model_input,
            t,
            encoder_hidden_states=encoder_hidden_states,
            cross_attention_kwargs=cross_attention_kwargs,
            return_dict=False,
        )[0]

    with pipeline.progress_bar(total=len(timesteps)) as progress_bar:
        for i, t in enumerate(timesteps):
            model_input = torch.cat([latents] * 2) if guidance else latents
            model_input = pipeline.scheduler.scale_model_input(model_input, t)
            grad_here = keep_grad is not None and keep_grad(i)
            if grad_here and gradient_checkpoint:
                noise_pred = checkpoint(unet_forward, model_input, t, embeds, use_reentrant=False)
            else:
                noise_pred = unet_forward(model_input, t, embeds)
            if keep_grad is not None and not grad_here:
                noise_pred = noise_pred.detach()
            if guidance:
                noise_uncond, noise_text = noise_pred.chunk(2)
                noise_pred = noise_uncond + guidance_scale * (noise_text - noise_uncond)
                if guidance_rescale > 0.0:
                    noise_pred = rescale_noise_cfg(noise_pred, noise_text, guidance_rescale=guidance_rescale)
            # A single generator also draws the step noise (a list of per-image generators only seeds the start).
            step_generator = generator if isinstance(generator, torch.Generator) else None
            step = scheduler_step(pipeline.scheduler, noise_pred, t, latents, eta, generator=step_generator)
            latents = step.latents
            all_latents.append(latents)
            all_log_probs.append(step.log_probs)
            progress_bar.update()
            if callback is not None and i % callback_steps == 0:
                callback(i, t, latents)
    return latents, all_latents, all_log_probs


def _decode(pipeline, latents: torch.Tensor, output_type: str, differentiable: bool):
    if output_type == "latent":
        return latents
    image = pipeline.vae.decode(latents / pipeline.vae.config.scaling_factor, return_dict=False)[0]
    if differentiable:
        # The image processor's postprocessing leaves autograd; this is the same map to [0, 1].
        image = (image / 2 + 0.5).clamp(0, 1)
        return image if output_type == "pt" else pipeline.image_processor.postprocess(image.detach(), output_type)
    return pipeline.image_processor.postprocess(image, output_type=output_type, do_denormalize=[True] * len(image))


# The `StableDiffusionPipeline.__call__` arguments both sampling entry points forward to the loop.
_SAMPLING_ARGS = (
    "prompt",
    "height",
    "width",
    "num_inference_steps",
    "guidance_scale",
    "negative_prompt",
    "num_images_per_prompt",
    "eta",
    "generator",
    "latents",
    "prompt_embeds",
    "negative_prompt_embeds",
    "cross_attention_kwargs",
    "guidance_rescale",
    "callback",
    "callback_steps",
)


def _sampling_args(arguments: dict[str, Any]) -> dict[str, Any]:
    return {name: arguments[name] for name in _SAMPLING_ARGS} | {"output_type": arguments["output_type"]}


def _sample(pipeline, sampling: dict[str, Any], keep_grad, gradient_checkpoint: bool) -> DDPOPipelineOutput:
    """Run the loop, decode (differentiably when gradients are kept) and package the output."""
    output_type = sampling.pop("output_type")
    latents, all_latents, all_log_probs = _denoise(
        pipeline, **sampling, keep_grad=keep_grad, gradient_checkpoint=gradient_checkpoint
    )
    image = _decode(pipeline, latents, output_type, differentiable=keep_grad is not None)
    pipeline.maybe_free_model_hooks()
    return DDPOPipelineOutput(image, all_latents, all_log_probs)


@torch.no_grad()
def pipeline_step(
    self,
    prompt: str | list[str] | None = None,
    height: int | None = None,
    width: int | None = None,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.5,
    negative_prompt: str | list[str] | None = None,
    num_images_per_prompt: int | None = 1,
    eta: float = 0.0,
    generator: torch.Generator | list[torch.Generator] | None = None,
    latents: torch.FloatTensor | None = None,
    prompt_embeds: torch.FloatTensor | None = None,
    negative_prompt_embeds: torch.FloatTensor | None = None,
    output_type: str | None = "pil",
    return_dict: bool = True,
    callback: Callable[[int, int, torch.FloatTensor], None] | None = None,
    callback_steps: int = 1,
    cross_attention_kwargs: dict[str, Any] | None = None,
    guidance_rescale: float = 0.0,
) -> DDPOPipelineOutput:
    """Sample from a `StableDiffusionPipeline` (passed as `self`) with DDIM, recording latents and log-probs.

    Arguments are those of `StableDiffusionPipeline.__call__`; `eta` is DDIM's noise weight (DDPO needs `eta > 0`
    for a stochastic policy). `return_dict` is accepted for signature compatibility; the output is always a
    [`DDPOPipelineOutput`].
    """
    return _sample(self, _sampling_args(locals()), keep_grad=None, gradient_checkpoint=False)


def pipeline_step_with_grad(
    pipeline,
    prompt: str | list[str] | None = None,
    height: int | None = None,
    width: int | None = None,
    num_inference_steps: int = 50,
    guidance_scale: float = 7.5,
    truncated_backprop: bool = True,
    truncated_backprop_rand: bool = True,
    gradient_checkpoint: bool = True,
    truncated_backprop_timestep: int = 49,
    truncated_rand_backprop_minmax: tuple = (0, 50),
    negative_prompt: str | list[str] | None = None,
    num_images_per_prompt: int | None = 1,
    eta: float = 0.0,
    generator: torch.Generator | list[torch.Generator] | None = None,
    latents: torch.FloatTensor | None = None,
    prompt_embeds: torch.FloatTensor | None = None,
    negative_prompt_embeds: torch.FloatTensor | None = None,
    output_type: str | None = "pil",
    return_dict: bool = True,
    callback: Callable[[int, int, torch.FloatTensor], None] | None = None,
    callback_steps: int = 1,
    cross_attention_kwargs: dict[str, Any] | None = None,
    guidance_rescale: float = 0.0,
) -> DDPOPipelineOutput:
    """Sample keeping gradients through the UNet, for reward backpropagation (AlignProp).

    With `truncated_backprop`, the UNet call of step `i` keeps its graph only if `i >= K` (otherwise its output is
    detached), where `K` is `truncated_backprop_timestep`, or, with `truncated_backprop_rand`, drawn uniformly from
    `truncated_rand_backprop_minmax` (inclusive, Python's `random`) anew at every step; `K` is capped at
    `num_inference_steps - 1`, so the last step always keeps its gradient. `gradient_checkpoint` recomputes the UNet's
    activations in the backward pass instead of storing them. Images come back in `[0, 1]` with their graph for
    `output_type="pt"`.
    """
    sampling = _sampling_args(locals())
    last_step = num_inference_steps - 1

    def keep_grad(i: int) -> bool:
        if not truncated_backprop:
            return True
        if truncated_backprop_rand:
            # A fresh draw at every step; one past the chain is capped so that the last step keeps its gradient.
            first_grad_step = min(random.randint(*truncated_rand_backprop_minmax), last_step)
        else:
            first_grad_step = min(truncated_backprop_timestep, last_step)
        return i >= first_grad_step

    return _sample(pipeline, sampling, keep_grad=keep_grad, gradient_checkpoint=gradient_checkpoint)


_LORA_TARGET_MODULES = ["to_k", "to_q", "to_v", "to_out.0"]
_LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"


class DefaultDDPOStableDiffusionPipeline(DDPOStableDiffusionPipeline):
    """[`DDPOStableDiffusionPipeline`] around a diffusers `StableDiffusionPipeline` with a DDIM scheduler.

    Args:
        pretrained_model_name (`str`):
            Path (or hub id) of a Stable Diffusion pipeline in diffusers layout. If the directory also holds
            `pytorch_lora_weights.safetensors` (what [`save_pretrained`] writes with LoRA), those weights are loaded
            into the UNet's adapter, so a trained adapter saved next to its base pipeline reloads in one call.
            Otherwise the adapter is added (randomly initialised) by the first `get_trainable_layers()` call, which
            the trainers make after seeding.
        pretrained_model_revision (`str`, *optional*, defaults to `"main"`):
            Hub revision.
        use_lora (`bool`, *optional*, defaults to `True`):
            Train a LoRA adapter (rank 4 on the attention projections) on a frozen UNet; otherwise train the UNet.
    """

    def __init__(self, pretrained_model_name: str, *, pretrained_model_revision: str = "main", use_lora: bool = True):
        from diffusers import DDIMScheduler, StableDiffusionPipeline

        self.sd_pipeline = StableDiffusionPipeline.from_pretrained(
            pretrained_model_name, revision=pretrained_model_revision
        )
        self.use_lora = use_lora
        self.pretrained_model = pretrained_model_name
        self.pretrained_revision = pretrained_model_revision

        pipe = self.sd_pipeline
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        pipe.safety_checker = None
        pipe.vae.requires_grad_(False)
        pipe.text_encoder.requires_grad_(False)
        pipe.unet.requires_grad_(not self.use_lora)
        self._lora_added = False
        if self.use_lora and os.path.isfile(os.path.join(pretrained_model_name, _LORA_WEIGHTS_NAME)):
            self._ensure_lora()
            self._load_lora_into_unet(pretrained_model_name)

    def _ensure_lora(self) -> None:
        """Add the LoRA adapter to the UNet once. Deferred to the trainer's first `get_trainable_layers()` call, so
        the adapter's random initialisation follows the trainer's seed."""
        if not self.use_lora or self._lora_added:
            return
        from peft import LoraConfig

        unet = self.sd_pipeline.unet
        unet.add_adapter(
            LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=_LORA_TARGET_MODULES)
        )
        for param in unet.parameters():
            if param.requires_grad:  # LoRA parameters train in float32 even in a half-precision UNet
                param.data = param.to(torch.float32)
        self._lora_added = True

    def _load_lora_into_unet(self, directory: str) -> None:
        from diffusers.utils import convert_unet_state_dict_to_peft
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(os.path.join(directory, _LORA_WEIGHTS_NAME))
        unet_state = {k.removeprefix("unet."): v for k, v in state.items() if k.startswith("unet.")}
        set_peft_model_state_dict(self.sd_pipeline.unet, convert_unet_state_dict_to_peft(unet_state))

    def __call__(self, *args, **kwargs) -> DDPOPipelineOutput:
        return pipeline_step(self.sd_pipeline, *args, **kwargs)

    def rgb_with_grad(self, *args, **kwargs) -> DDPOPipelineOutput:
        return pipeline_step_with_grad(self.sd_pipeline, *args, **kwargs)

    def scheduler_step(self, *args, **kwargs) -> DDPOSchedulerOutput:
        return scheduler_step(self.sd_pipeline.scheduler, *args, **kwargs)

    @property
    def unet(self):
        return self.sd_pipeline.unet

    @property
    def vae(self):
        return self.sd_pipeline.vae

    @property
    def tokenizer(self):
        return self.sd_pipeline.tokenizer

    @property
    def scheduler(self):
        return self.sd_pipeline.scheduler

    @property
    def text_encoder(self):
        return self.sd_pipeline.text_encoder

    @property
    def autocast(self):
        """`None` with LoRA: the frozen UNet runs in the inference dtype and its float32 adapter needs the trainer's
        mixed-precision autocast; without LoRA, accelerate's prepared UNet handles precision itself."""
        return None if self.use_lora else contextlib.nullcontext

    def save_pretrained(self, output_dir: str) -> None:
        """Write the LoRA weights (`pytorch_lora_weights.safetensors`, diffusers format) or the full pipeline."""
        if self.use_lora:
            self._ensure_lora()
            self._save_lora(self.sd_pipeline.unet, output_dir)
        else:
            self.sd_pipeline.save_pretrained(output_dir)

    @staticmethod
    def _save_lora(unet, output_dir: str) -> None:
        from diffusers import StableDiffusionPipeline
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft import get_peft_model_state_dict

        state = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
        StableDiffusionPipeline.save_lora_weights(save_directory=output_dir, unet_lora_layers=state)

    def set_progress_bar_config(self, *args, **kwargs):
        self.sd_pipeline.set_progress_bar_config(*args, **kwargs)

    def get_trainable_layers(self):
        """The UNet: with `use_lora` only its adapter parameters (added on the first call) require gradients."""
        self._ensure_lora()
        return self.sd_pipeline.unet

    def save_checkpoint(self, models, weights, output_dir):
        """Accelerate `save_state` pre-hook: write the trained part, and leave accelerate nothing else to save."""
        if len(models) != 1:
            raise ValueError(f"Expected one model to checkpoint (the UNet or its LoRA parameters), got {len(models)}.")
        if self.use_lora and getattr(models[0], "peft_config", None):
            self._save_lora(models[0], output_dir)
        elif not self.use_lora and models[0].__class__.__name__ == "UNet2DConditionModel":
            models[0].save_pretrained(os.path.join(output_dir, "unet"))
        else:
            raise ValueError(f"Unknown model type {type(models[0]).__name__} to checkpoint.")
        weights.pop()

    def load_checkpoint(self, models, input_dir):
        """Accelerate `load_state` pre-hook: read the trained part back from `input_dir`."""
        if len(models) != 1:
            raise ValueError(f"Expected one model to restore (the UNet or its LoRA parameters), got {len(models)}.")
        model = models.pop()
        if self.use_lora:
            self._ensure_lora()
            self._load_lora_into_unet(input_dir)
        elif model.__class__.__name__ == "UNet2DConditionModel":
            from diffusers import UNet2DConditionModel

            loaded = UNet2DConditionModel.from_pretrained(input_dir, subfolder="unet")
            model.register_to_config(**loaded.config)
            model.load_state_dict(loaded.state_dict())
            del loaded
        else:
            raise ValueError(f"Unknown model type {type(model).__name__} to restore.")

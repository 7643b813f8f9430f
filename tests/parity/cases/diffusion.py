"""DDPO and AlignProp against TRL 0.22 (`oracle="0.22"`, the last series shipping them; transformers 4.57 there).

The two sides import the pieces from different places (TRL 0.22: `trl.DDPOConfig`, `trl.trainer.utils`; here:
`trl.experimental.ddpo`, `trl.experimental.alignprop`); `_api()` picks whichever exists. Compared: the configs'
defaults, the DDIM step's log-probability and sample on fixed tensors, the clipped loss, the per-prompt statistics,
and short training runs on the tiny Stable Diffusion pipeline (the values each trainer logs).
"""

from __future__ import annotations

import dataclasses

from . import case


ORACLE = "0.22"
PIPELINE = "tiny-StableDiffusionPipeline"


def _api():
    import trl

    try:
        from trl.experimental.alignprop import AlignPropConfig, AlignPropTrainer
        from trl.experimental.ddpo import DDPOConfig, DDPOTrainer, PerPromptStatTracker
    except ImportError:
        from trl import AlignPropConfig, AlignPropTrainer, DDPOConfig, DDPOTrainer
        from trl.trainer.utils import PerPromptStatTracker
    from trl.models.modeling_sd_base import DefaultDDPOStableDiffusionPipeline, scheduler_step

    return {
        "trl": trl,
        "DDPOConfig": DDPOConfig,
        "DDPOTrainer": DDPOTrainer,
        "AlignPropConfig": AlignPropConfig,
        "AlignPropTrainer": AlignPropTrainer,
        "PerPromptStatTracker": PerPromptStatTracker,
        "DefaultDDPOStableDiffusionPipeline": DefaultDDPOStableDiffusionPipeline,
        "scheduler_step": scheduler_step,
    }


def _fields(config) -> dict:
    from .dataclass_fields import PROJECT_ADDITIONS

    out = {}
    for f in dataclasses.fields(config):
        if f.name in PROJECT_ADDITIONS:  # this project's run-report switch, listed in docs/parity.md
            continue
        value = getattr(config, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


@case("ddpo/config_defaults", oracle=ORACLE)
def ddpo_config_defaults(ctx):
    return _fields(_api()["DDPOConfig"]())


@case("alignprop/config_defaults", oracle=ORACLE)
def alignprop_config_defaults(ctx):
    return _fields(_api()["AlignPropConfig"]())


def _scheduler(ctx, num_steps=5):
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler.from_pretrained(ctx.assets[f"pipelines/{PIPELINE}"], subfolder="scheduler")
    scheduler.set_timesteps(num_steps)
    return scheduler


def _tensors(n, shape=(3, 4, 4, 4)):
    import torch

    generator = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=generator) for _ in range(n)]


@case("ddpo/scheduler_step_log_prob", oracle=ORACLE)
def scheduler_step_log_prob(ctx):
    import torch

    step = _api()["scheduler_step"]
    scheduler = _scheduler(ctx)
    x, eps, prev = _tensors(3)
    out = {}
    for i, t in enumerate(scheduler.timesteps):  # 0-d tensors: TRL 0.22's step takes no Python ints
        for eta in (1.0, 0.5):
            result = step(scheduler, eps, t, x, eta=eta, prev_sample=prev)
            out[f"t{i}/eta={eta}"] = result.log_probs.tolist()
    # Per-example timesteps, as in DDPO's training pass.
    timesteps = scheduler.timesteps[torch.tensor([0, 2, 4])]
    out["per_example"] = step(scheduler, eps, timesteps, x, eta=1.0, prev_sample=prev).log_probs.tolist()
    return out


@case("ddpo/scheduler_step_sample", oracle=ORACLE)
def scheduler_step_sample(ctx):
    import torch

    step = _api()["scheduler_step"]
    scheduler = _scheduler(ctx)
    x, eps = _tensors(2)
    result = step(scheduler, eps, scheduler.timesteps[1], x, eta=1.0, generator=torch.Generator().manual_seed(3))
    return {
        "latents_sum": result.latents.sum().item(),
        "latents_norm": result.latents.norm().item(),
        "log_probs": result.log_probs.tolist(),
    }


@case("ddpo/clipped_loss", oracle=ORACLE)
def clipped_loss(ctx):
    import torch

    trainer_cls = _api()["DDPOTrainer"]
    advantages = torch.tensor([1.0, -2.0, 0.5, -0.5, 3.0, 0.0])
    ratio = torch.tensor([1.3, 1.3, 0.6, 0.95, 1.0, 2.0])
    return {f"clip={c}": trainer_cls.loss(None, advantages, c, ratio).item() for c in (1e-4, 0.2, 1.0)}


@case("ddpo/per_prompt_stat_tracker", oracle=ORACLE)
def per_prompt_stat_tracker(ctx):
    import numpy as np

    tracker = _api()["PerPromptStatTracker"](buffer_size=4, min_count=2)
    first = tracker.update(np.array(["a", "a", "b", "a"]), np.array([1.0, 2.0, 3.0, 5.0]))
    second = tracker.update(np.array(["a", "b", "b", "c"]), np.array([4.0, 6.0, 1.0, 2.0]))
    stats = {str(k): {kk: float(vv) for kk, vv in v.items()} for k, v in tracker.get_stats().items()}
    return {"first": first.tolist(), "second": second.tolist(), "stats": stats}


@case("ddpo/errors/sample_smaller_than_train_batch", phrases=("sample batch size", "train batch size"), oracle=ORACLE)
def sample_smaller_than_train_batch(ctx):
    return _run(ctx, "ddpo", dict(sample_batch_size=2, train_batch_size=4), expect_error=True)


def _record_logs():
    import accelerate
    import numpy as np

    logged = []

    def log(self, values, step=None, log_kwargs=None):
        row = {}
        for key, value in values.items():
            array = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value, dtype=float)
            row[key] = array.tolist()
        logged.append({"step": step, **row})

    accelerate.Accelerator.log = log
    return logged


def _run(ctx, method, overrides, expect_error=False):
    import accelerate
    import torch

    api = _api()
    accelerate.PartialState()  # TRL 0.22's pipeline logs through accelerate's logger, which needs the state
    logged = _record_logs()
    prompts = iter(["a red cat", "a blue dog"] * 100)

    def prompt_fn():
        return next(prompts), {}

    def reward_fn(images, prompts, metadata):
        return images.float().mean(dim=(1, 2, 3)), {}

    torch.manual_seed(0)
    common = dict(
        num_epochs=2,
        sample_num_steps=3,
        mixed_precision="no",
        logdir=ctx.tmpdir(),
        save_freq=1000,
        log_with=None,
        train_learning_rate=1e-2,
    )
    try:
        if method == "ddpo":
            config = api["DDPOConfig"](
                **{
                    **common,
                    "sample_batch_size": 2,
                    "sample_num_batches_per_epoch": 2,
                    "train_batch_size": 2,
                    **overrides,
                }
            )
            trainer_cls = api["DDPOTrainer"]
        else:
            config = api["AlignPropConfig"](**{**common, "train_batch_size": 2, **overrides})
            trainer_cls = api["AlignPropTrainer"]
        pipeline = api["DefaultDDPOStableDiffusionPipeline"](ctx.assets[f"pipelines/{PIPELINE}"])
        trainer = trainer_cls(config, reward_fn, prompt_fn, pipeline)
    except ValueError as error:
        if expect_error:
            return {"exception": {"type": type(error).__name__, "message": str(error)}}
        raise
    trainer.train()
    return {"logs": logged}


@case("ddpo/train", oracle=ORACLE)
def ddpo_train(ctx):
    return _run(ctx, "ddpo", {})


@case("ddpo/train/no_cfg_two_inner_epochs", oracle=ORACLE)
def ddpo_train_no_cfg(ctx):
    return _run(ctx, "ddpo", {"train_cfg": False, "train_num_inner_epochs": 2, "train_timestep_fraction": 0.67})


@case("alignprop/train", oracle=ORACLE)
def alignprop_train(ctx):
    return _run(ctx, "alignprop", {"truncated_backprop_rand": False, "truncated_backprop_timestep": 1})


@case("alignprop/train/random_truncation", oracle=ORACLE)
def alignprop_train_random(ctx):
    return _run(ctx, "alignprop", {"truncated_rand_backprop_minmax": (0, 2), "train_gradient_accumulation_steps": 2})

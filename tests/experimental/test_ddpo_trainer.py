"""DDPO: the DDIM step's log-probability, the clipped loss, per-prompt statistics, config checks, training."""

import math
import os
import statistics

import numpy as np
import pytest
import torch


pytest.importorskip("diffusers")

from diffusers import DDIMScheduler  # noqa: E402
from diffusion_helpers import (  # noqa: E402
    RecordingTracker,
    cycling_prompt_fn,
    mean_brightness,
    tiny_pipeline,
    trainable_snapshot,
)

from trl.experimental.ddpo import DDPOConfig, DDPOTrainer, PerPromptStatTracker  # noqa: E402
from trl.models import scheduler_step  # noqa: E402
from trl.rewards import image_brightness_reward  # noqa: E402


pytestmark = pytest.mark.usefixtures("single_thread")


def _scheduler(num_steps=10):
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    scheduler.set_timesteps(num_steps)
    return scheduler


def _hand_log_prob(scheduler, eps, t, x, prev, eta):
    """log N(prev; mu, sigma^2) averaged over elements, from DDIM's formulas written out per example."""
    out = []
    for i in range(x.shape[0]):
        ti = int(t[i])
        prev_t = ti - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
        a_t = scheduler.alphas_cumprod[ti].item()
        a_prev = scheduler.alphas_cumprod[prev_t].item() if prev_t >= 0 else scheduler.final_alpha_cumprod.item()
        x0 = (x[i] - math.sqrt(1 - a_t) * eps[i]) / math.sqrt(a_t)
        sigma = eta * math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
        mean = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev - sigma**2) * eps[i]
        density = -((prev[i] - mean) ** 2) / (2 * sigma**2) - math.log(sigma) - 0.5 * math.log(2 * math.pi)
        out.append(density.mean().item())
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("eta", [1.0, 0.3])
def test_ddim_step_log_prob_is_the_gaussian_density(eta):
    torch.manual_seed(0)
    scheduler = _scheduler()
    x, eps, prev = torch.randn(3, 3, 2, 4, 4, dtype=torch.float64).unbind(0)
    # One timestep per example, the last one (whose previous timestep is before the schedule) included.
    t = scheduler.timesteps[[0, 4, -1]]
    output = scheduler_step(scheduler, eps, t, x, eta=eta, prev_sample=prev)
    torch.testing.assert_close(output.log_probs, _hand_log_prob(scheduler, eps, t, x, prev, eta), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(output.latents, prev)


def test_ddim_step_sample_matches_diffusers_step():
    torch.manual_seed(0)
    scheduler = _scheduler()
    x, eps = torch.randn(2, 2, 4, 4, 4).unbind(0)
    t = scheduler.timesteps[3]
    ours = scheduler_step(scheduler, eps, t, x, eta=0.7, generator=torch.Generator().manual_seed(5))
    reference = scheduler.step(eps, t, x, eta=0.7, generator=torch.Generator().manual_seed(5)).prev_sample
    torch.testing.assert_close(ours.latents, reference, rtol=1e-5, atol=1e-5)
    # The sample drawn is scored under the same Gaussian.
    scored = scheduler_step(scheduler, eps, t.repeat(2), x, eta=0.7, prev_sample=ours.latents)
    torch.testing.assert_close(scored.log_probs, ours.log_probs)


def test_clipped_loss_matches_hand_formula():
    advantages = torch.tensor([1.0, -2.0, 0.5, -0.5, 3.0])
    ratio = torch.tensor([1.3, 1.3, 0.6, 0.95, 1.0])
    clip = 0.2
    expected = []
    for a, r in zip(advantages.tolist(), ratio.tolist(), strict=True):
        clipped_r = min(max(r, 1 - clip), 1 + clip)
        expected.append(max(-a * r, -a * clipped_r))
    loss = DDPOTrainer.loss(None, advantages, clip, ratio)
    assert loss.item() == pytest.approx(sum(expected) / len(expected))


def test_stat_tracker_normalises_per_prompt():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=2)
    # "b" has one reward (< min_count): the batch statistics normalise it.
    got = tracker.update(np.array(["a", "a", "b", "a"]), np.array([1.0, 2.0, 3.0, 5.0]))
    a_mean, a_std = statistics.fmean([1, 2, 5]), statistics.pstdev([1, 2, 5])
    all_mean, all_std = statistics.fmean([1, 2, 3, 5]), statistics.pstdev([1, 2, 3, 5])
    expected = [(1 - a_mean) / a_std, (2 - a_mean) / a_std, (3 - all_mean) / all_std, (5 - a_mean) / a_std]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # The buffer keeps the last 4 rewards of "a": [1, 2, 5, 4] -> [2, 5, 4, 7] after the next call.
    got = tracker.update(np.array(["a", "b", "a"]), np.array([4.0, 6.0, 7.0]))
    a_buf, b_buf = [2, 5, 4, 7], [3, 6]
    expected = [
        (4 - statistics.fmean(a_buf)) / statistics.pstdev(a_buf),
        (6 - statistics.fmean(b_buf)) / statistics.pstdev(b_buf),
        (7 - statistics.fmean(a_buf)) / statistics.pstdev(a_buf),
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    stats = tracker.get_stats()
    assert stats["a"]["count"] == 4 and stats["b"]["count"] == 2
    assert stats["b"]["mean"] == pytest.approx(4.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sample_batch_size": 2, "train_batch_size": 3}, "at least the train batch size"),
        ({"sample_batch_size": 4, "train_batch_size": 3}, "divisible by train_batch_size"),
        (
            {"sample_batch_size": 2, "sample_num_batches_per_epoch": 1, "train_gradient_accumulation_steps": 4},
            "whole optimizer steps",
        ),
        ({"sample_eta": 0.0}, "sample_eta must be > 0"),
        ({"train_timestep_fraction": 0.0}, "train_timestep_fraction"),
        ({"mixed_precision": "fp8"}, "mixed_precision"),
    ],
)
def test_bad_config_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DDPOConfig(**kwargs)


def _config(tmp_path, **overrides):
    kwargs = {
        "num_epochs": 2,
        "sample_num_steps": 3,
        "sample_batch_size": 4,
        "sample_num_batches_per_epoch": 1,
        "train_batch_size": 2,
        "mixed_precision": "no",
        "logdir": str(tmp_path / "logs"),
        "train_learning_rate": 1e-2,
    }
    return DDPOConfig(**{**kwargs, **overrides})


def test_ddpo_trains_logs_checkpoints_and_resumes(tmp_path):
    tracker = RecordingTracker()
    hook_calls = []
    pipeline = tiny_pipeline()
    before = trainable_snapshot(pipeline)
    config = _config(tmp_path, log_with=[tracker], per_prompt_stat_tracking=True, per_prompt_stat_tracking_min_count=2)
    trainer = DDPOTrainer(config, image_brightness_reward, cycling_prompt_fn(), pipeline)
    trainer.train()

    after = trainable_snapshot(pipeline)
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert set(before) == {n for n, _ in pipeline.unet.named_parameters() if "lora" in n}
    epoch_logs = [values for _, values in tracker.logs if "reward" in values]
    step_logs = [values for _, values in tracker.logs if "loss" in values]
    assert len(epoch_logs) == 2 and len(epoch_logs[0]["reward"]) == 4
    assert set(epoch_logs[0]) == {"reward", "epoch", "reward_mean", "reward_std"}
    # 4 samples in batches of 2 with no accumulation: two optimizer steps an epoch.
    assert len(step_logs) == 4 and set(step_logs[0]) == {"loss", "approx_kl", "clipfrac", "epoch", "inner_epoch"}
    assert all(math.isfinite(v["loss"]) for v in step_logs)
    assert [step for step, values in tracker.logs if "loss" in values] == [0, 1, 2, 3]
    assert tracker.images and tracker.images[0][1]["images"].shape == (4, 32, 32, 3)
    assert tracker.config["sample_num_steps"] == 3
    assert len(trainer.stat_tracker.get_stats()) == 2

    checkpoints = sorted(os.listdir(tmp_path / "logs" / "checkpoints"))
    assert checkpoints == ["checkpoint_0", "checkpoint_1"]
    assert "pytorch_lora_weights.safetensors" in os.listdir(tmp_path / "logs" / "checkpoints" / "checkpoint_1")

    # The run report: every scalar logged (the per-sample reward array left out), checkpoints, curves.
    from trl.trainer.run_report import load_run

    history = load_run(str(tmp_path / "logs"))
    assert history.status == "finished" and history.run["trainer"] == "DDPOTrainer"
    assert [row["step"] for row in history.logs if "loss" in row] == [0, 1, 2, 3]
    assert "reward_mean" in history.metric_names() and "reward" not in history.metric_names()
    assert len(history.checkpoints) == 2
    page = (tmp_path / "logs" / "report.html").read_text()
    assert "<svg" in page and "reward_mean" in page

    # Resume from the first checkpoint: the adapter is the one saved after epoch 0, the run continues at epoch 1.
    resumed_pipeline = tiny_pipeline()
    resumed = DDPOTrainer(
        _config(tmp_path, resume_from=str(tmp_path / "logs" / "checkpoints" / "checkpoint_0")),
        image_brightness_reward,
        cycling_prompt_fn(),
        resumed_pipeline,
        image_samples_hook=lambda data, step, tracker: hook_calls.append((len(data), step, tracker)),
    )
    assert (resumed.first_epoch, resumed.global_step) == (1, 2)
    resumed_params = trainable_snapshot(resumed_pipeline)
    assert any(not torch.equal(before[name], resumed_params[name]) for name in before)
    resumed.train()
    assert hook_calls == [(1, 2, None)]
    assert resumed.global_step == 4


def test_ddpo_lora_saves_and_reloads_into_a_pipeline(tmp_path):
    from diffusers import StableDiffusionPipeline

    from trl.assets import get_diffusion_pipeline_path

    pipeline = tiny_pipeline()
    trainer = DDPOTrainer(_config(tmp_path, num_epochs=1), image_brightness_reward, cycling_prompt_fn(), pipeline)
    trainer.train()
    trainer.save_pretrained(str(tmp_path / "lora"))
    assert sorted(os.listdir(tmp_path / "lora")) == ["README.md", "pytorch_lora_weights.safetensors"]

    # Into a plain diffusers pipeline, through diffusers' own LoRA loader: same images as the trained pipeline.
    plain = StableDiffusionPipeline.from_pretrained(get_diffusion_pipeline_path())
    plain.set_progress_bar_config(disable=True)
    plain.load_lora_weights(str(tmp_path / "lora"), weight_name="pytorch_lora_weights.safetensors")
    latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    kwargs = {"num_inference_steps": 2, "guidance_scale": 1.0, "output_type": "pt", "latents": latents}
    expected = pipeline.sd_pipeline("a red cat", **kwargs).images
    torch.testing.assert_close(plain("a red cat", **kwargs).images, expected, rtol=1e-4, atol=1e-5)


def test_ddpo_raises_the_brightness_reward(tmp_path):
    """The reward's sign drives the update: the same run rewarding brightness ends brighter than one rewarding
    darkness (the change of one run alone, ~1e-4 to 1e-3 in 24 tiny epochs, depends on the CPU's rounding)."""

    def darkness_reward(images, prompts, metadata):
        rewards, info = image_brightness_reward(images, prompts, metadata)
        return -rewards, info

    brightness = {}
    for name, reward in (("bright", image_brightness_reward), ("dark", darkness_reward)):
        torch.manual_seed(0)
        pipeline = tiny_pipeline()
        config = _config(
            tmp_path / name, num_epochs=24, sample_num_steps=4, sample_batch_size=8, train_batch_size=8, save_freq=1000
        )
        DDPOTrainer(config, reward, cycling_prompt_fn(), pipeline).train()
        with torch.no_grad():
            brightness[name] = mean_brightness(pipeline)
    assert brightness["bright"] > brightness["dark"] + 5e-4, brightness


def test_ddpo_async_rewards_and_bad_reward_output(tmp_path):
    calls = []

    def reward_fn(images, prompts, metadata):
        calls.append((tuple(prompts), tuple(m["index"] for m in metadata)))
        return images.mean(dim=(1, 2, 3)), {}

    trainer = DDPOTrainer(
        _config(tmp_path, num_epochs=1, async_reward_computation=True, train_cfg=False),
        reward_fn,
        cycling_prompt_fn(),
        tiny_pipeline(),
    )
    trainer.train()
    assert calls == [(("a red cat", "a blue dog") * 2, (0, 1) * 2)]

    bad = DDPOTrainer(_config(tmp_path, num_epochs=1), lambda i, p, m: i.mean(), cycling_prompt_fn(), tiny_pipeline())
    with pytest.raises(ValueError, match=r"\(rewards, reward_metadata\)"):
        bad.train()


def test_ddpo_after_a_bf16_trainer_in_the_same_process(tmp_path):
    """A transformers trainer built earlier in the process leaves accelerate's shared state at its own mixed precision
    (bf16, the default on a GPU); DDPO starts from a fresh state with its configured one instead of refusing it."""
    from datasets import Dataset

    from trl import SFTConfig, SFTTrainer
    from trl.assets import get_model_path

    sft_args = SFTConfig(output_dir=str(tmp_path / "sft"), bf16=True, use_cpu=True, report_to="none", max_steps=1)
    sft = SFTTrainer(
        get_model_path("tiny-Qwen2ForCausalLM"), args=sft_args, train_dataset=Dataset.from_dict({"text": ["a b"]})
    )
    assert sft.accelerator.mixed_precision == "bf16"
    trainer = DDPOTrainer(
        _config(tmp_path, num_epochs=1), image_brightness_reward, cycling_prompt_fn(), tiny_pipeline()
    )
    assert trainer.accelerator.mixed_precision == "no"

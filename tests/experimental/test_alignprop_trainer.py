"""AlignProp: truncated backpropagation through the sampler, config checks, training, checkpoints."""

import os

import pytest
import torch


pytest.importorskip("diffusers")

from diffusion_helpers import (  # noqa: E402
    RecordingTracker,
    cycling_prompt_fn,
    mean_brightness,
    tiny_pipeline,
    trainable_snapshot,
)

from trl.experimental.alignprop import AlignPropConfig, AlignPropTrainer  # noqa: E402
from trl.rewards import get_color_target_reward, image_brightness_reward  # noqa: E402


pytestmark = pytest.mark.usefixtures("single_thread")


def _config(tmp_path, **overrides):
    kwargs = {
        "num_epochs": 2,
        "sample_num_steps": 3,
        "train_batch_size": 2,
        "mixed_precision": "no",
        "logdir": str(tmp_path / "logs"),
        "truncated_rand_backprop_minmax": (0, 2),
    }
    return AlignPropConfig(**{**kwargs, **overrides})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"truncated_backprop_rand": False, "truncated_backprop_timestep": 50}, r"\[0, sample_num_steps\)"),
        ({"truncated_rand_backprop_minmax": (3, 1)}, "low <= high"),
        ({"sample_num_steps": 4, "truncated_rand_backprop_minmax": (4, 9)}, "below sample_num_steps"),
        ({"log_image_freq": 0}, "log_image_freq"),
        ({"train_batch_size": 0}, "positive integer"),
    ],
)
def test_bad_config_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlignPropConfig(**kwargs)


def test_truncated_backprop_keeps_gradients_of_the_last_steps():
    """Steps before `truncated_backprop_timestep` are detached: fewer kept steps give another (non-zero) gradient."""
    pipeline = tiny_pipeline()
    latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    grads = {}
    for first_grad_step in (0, 2):
        output = pipeline.rgb_with_grad(
            ["a red cat"],
            num_inference_steps=3,
            guidance_scale=1.0,
            eta=1.0,
            output_type="pt",
            latents=latents,
            generator=torch.Generator().manual_seed(1),
            truncated_backprop_rand=False,
            truncated_backprop_timestep=first_grad_step,
            gradient_checkpoint=first_grad_step == 0,
        )
        assert output.images.requires_grad and output.images.shape == (1, 3, 32, 32)
        pipeline.unet.zero_grad(set_to_none=True)
        output.images.mean().backward()
        grads[first_grad_step] = torch.cat([p.grad.flatten() for p in pipeline.unet.parameters() if p.requires_grad])
    assert grads[0].abs().sum() > 0 and grads[2].abs().sum() > 0
    assert not torch.allclose(grads[0], grads[2])


def test_alignprop_trains_logs_and_resumes(tmp_path):
    tracker = RecordingTracker()
    pipeline = tiny_pipeline()
    before = trainable_snapshot(pipeline)
    config = _config(tmp_path, log_with=[tracker], train_gradient_accumulation_steps=2)
    trainer = AlignPropTrainer(config, image_brightness_reward, cycling_prompt_fn(), pipeline)
    trainer.train()

    after = trainable_snapshot(pipeline)
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert [step for step, _ in tracker.logs] == [0, 1]
    assert set(tracker.logs[0][1]) == {"reward_mean", "reward_std", "loss", "epoch"}
    assert tracker.logs[0][1]["loss"] == pytest.approx(10.0 - tracker.logs[0][1]["reward_mean"], abs=1e-5)
    assert [step for step, _ in tracker.images] == [1, 2]
    assert tracker.images[0][1]["images"].shape == (2, 32, 32, 3)
    assert sorted(os.listdir(tmp_path / "logs" / "checkpoints")) == ["checkpoint_0", "checkpoint_1"]
    from trl.trainer.run_report import load_run

    history = load_run(str(tmp_path / "logs"))  # the run report: both steps' metrics, checkpoints, the page
    assert history.status == "finished" and [row["step"] for row in history.logs] == [0, 1]
    assert len(history.checkpoints) == 2 and (tmp_path / "logs" / "report.html").is_file()

    hook_calls = []
    resumed = AlignPropTrainer(
        _config(tmp_path, num_epochs=3, resume_from=str(tmp_path / "logs" / "checkpoints")),
        image_brightness_reward,
        cycling_prompt_fn(),
        tiny_pipeline(),
        image_samples_hook=lambda data, step, tracker: hook_calls.append((sorted(data), step)),
    )
    assert (resumed.first_epoch, resumed.global_step) == (2, 2)
    resumed_params = trainable_snapshot(resumed.sd_pipeline)
    for name in after:
        torch.testing.assert_close(resumed_params[name], after[name])
    resumed.train()
    assert hook_calls == [(["images", "prompt_metadata", "prompts", "rewards"], 3)]


def test_alignprop_raises_the_brightness_reward(tmp_path):
    torch.manual_seed(0)
    pipeline = tiny_pipeline()
    with torch.no_grad():
        before = mean_brightness(pipeline)
    config = _config(
        tmp_path,
        num_epochs=12,
        sample_num_steps=4,
        train_batch_size=4,
        train_learning_rate=1e-2,
        truncated_rand_backprop_minmax=(0, 3),
        save_freq=1000,
    )
    AlignPropTrainer(config, image_brightness_reward, cycling_prompt_fn(), pipeline).train()
    with torch.no_grad():
        after = mean_brightness(pipeline)
    assert after > before + 2e-3, (before, after)


def test_alignprop_rejects_a_reward_without_gradient(tmp_path):
    def numpy_reward(images, prompts, metadata):
        return torch.tensor(images.detach().mean(dim=(1, 2, 3)).numpy()), {}

    trainer = AlignPropTrainer(_config(tmp_path, num_epochs=1), numpy_reward, cycling_prompt_fn(), tiny_pipeline())
    with pytest.raises(ValueError, match="require grad"):
        trainer.train()


def test_color_target_reward():
    images = torch.zeros(2, 3, 4, 4)
    images[0, 0] = 1.0  # pure red
    rewards, metadata = get_color_target_reward((1.0, 0.0, 0.0))(images, ["a", "b"], [{}, {}])
    torch.testing.assert_close(rewards, torch.tensor([0.0, -1.0]))
    torch.testing.assert_close(metadata["mean_color"][0], torch.tensor([1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="three RGB values"):
        get_color_target_reward((2.0, 0.0))

"""MergeModelCallback, MergeConfig and merge_models with the real mergekit: a linear merge equals the hand-computed
weight average, TIES / DARE-TIES / SLERP merges load, and the callback writes a loadable merged checkpoint."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl import SFTConfig, SFTTrainer
from trl.assets import get_model_path, load_test_dataset


pytest.importorskip("mergekit", reason="needs the `merge` extra (mergekit)")

from trl.experimental.merge_model_callback import MergeConfig, MergeModelCallback, merge_models  # noqa: E402


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """A tiny model and a perturbed copy, saved in float32."""
    root = tmp_path_factory.mktemp("merge-inputs")
    first = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    second = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in second.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    first.save_pretrained(root / "policy")
    second.save_pretrained(root / "target")
    return str(root / "policy"), str(root / "target"), first, second


def _merge(method, policy, target, out, **settings):
    config = MergeConfig(method)
    config.dtype = "float32"
    config.policy_model_path, config.target_model_path = policy, target
    for name, value in settings.items():
        setattr(config, name, value)
    merge_models(config.create(), str(out))
    return AutoModelForCausalLM.from_pretrained(str(out))


def test_config_defaults_and_bad_method():
    linear = MergeConfig()
    assert (linear.method, linear.dtype, linear.policy_model_weight, linear.target_model_weight) == (
        "linear",
        "float16",
        0.5,
        0.5,
    )
    ties = MergeConfig("dare_ties")
    assert (
        ties.policy_model_density == [1.0, 0.7, 0.1] and ties.target_model_density == [1.0] and ties.normalize == 1.0
    )
    assert MergeConfig("slerp").t_values == 0.5
    with pytest.raises(ValueError, match="Unsupported merge method"):
        MergeConfig("average")
    with pytest.raises(ValueError, match="policy_model_path and target_model_path"):
        MergeConfig().create()


def test_linear_merge_is_the_weighted_average(tmp_path, two_models):
    policy, target, first, second = two_models
    merged = _merge("linear", policy, target, tmp_path / "m", policy_model_weight=0.3, target_model_weight=0.7)
    for name, param in merged.named_parameters():
        expected = 0.3 * first.get_parameter(name) + 0.7 * second.get_parameter(name)
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6)


def test_slerp_endpoints_and_other_methods_load(tmp_path, two_models):
    policy, target, first, second = two_models
    at_policy = _merge("slerp", policy, target, tmp_path / "s0", t_values=0.0)
    for name, param in at_policy.named_parameters():
        torch.testing.assert_close(param, first.get_parameter(name))
    for method in ("ties", "dare_ties", "slerp"):
        merged = _merge(method, policy, target, tmp_path / method)
        changed = any(not torch.equal(param, first.get_parameter(name)) for name, param in merged.named_parameters())
        assert changed, method


def test_callback_writes_a_loadable_merged_checkpoint(tmp_path):
    model_path = get_model_path("tiny-Qwen2ForCausalLM")
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        save_strategy="steps",
        save_steps=2,
        per_device_train_batch_size=2,
        report_to="none",
        disable_tqdm=True,
        learning_rate=1e-2,
    )
    merge_config = MergeConfig("linear")
    merge_config.dtype = "float32"
    trainer = SFTTrainer(
        model=model_path,
        args=args,
        train_dataset=load_test_dataset("standard_language_modeling", split="train"),
        callbacks=[MergeModelCallback(merge_config)],
    )
    trainer.train()
    merged_dir = tmp_path / "checkpoint-2" / "merged"
    assert os.path.isfile(merged_dir / "config.json")
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir))
    base = AutoModelForCausalLM.from_pretrained(model_path)
    for name, param in merged.named_parameters():
        expected = 0.5 * trainer.model.get_parameter(name).detach() + 0.5 * base.get_parameter(name)
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6)


def test_callback_refuses_a_run_that_saves_nothing(tmp_path):
    trainer = SFTTrainer(
        model=get_model_path("tiny-Qwen2ForCausalLM"),
        args=SFTConfig(output_dir=str(tmp_path), max_steps=1, save_strategy="no", report_to="none"),
        train_dataset=load_test_dataset("standard_language_modeling", split="train"),
        callbacks=[MergeModelCallback()],
    )
    with pytest.raises(ValueError, match="save_strategy='no'"):
        trainer.train()

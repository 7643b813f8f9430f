"""GRPO and RLOO generating from image prompts through vLLM (run in the vLLM environment: `make test-vllm`).

vLLM receives each prompt's token ids with one placeholder per image plus the images as multi-modal data, and expands
the placeholders with its own processor; the trainer checks the expanded prompt is the one its processor trains on.
Layouts: image tiles (Idefics3, vLLM's own implementation) in colocate and server mode, fixed-size images (LLaVA,
vLLM's transformers backend) in server mode. The grid layout (Qwen2-VL) needs torchvision in vLLM, absent here.
The unmarked tests run in the main environment with a stand-in for the vLLM back-end (what the trainer sends, the
check of the expanded prompt) and check the server's sampling parameters.
"""

import pytest
from trainer_utils import (
    assert_rewards_saw_group_images,
    changed_params,
    recording_image_reward,
    requires_qwen2_vl_processor,
    snapshot,
    train_logs,
)
from vllm_utils import free_port, online_args, requires_vllm, running_server

from trl.assets import get_model_path, load_test_dataset


pytest.importorskip("PIL")


# ---------------------------------------------------------------------------------------------------------------------
# Main environment (no vLLM): the trainer's side, with a stand-in for the vLLM back-end
# ---------------------------------------------------------------------------------------------------------------------
class _StandInVLLM:
    """Records what the trainer sends and answers as vLLM would: placeholders expanded by the model's processor
    (or, with `drop_prompt_tokens`, a prompt shorter than the trainer's), fixed completions."""

    def __init__(self, processor, drop_prompt_tokens=0):
        self.processor, self.drop_prompt_tokens, self.calls = processor, drop_prompt_tokens, []

    def generate(self, prompt_ids, model=None, weights_version=None, images=None):
        self.calls.append((prompt_ids, images))
        tokenizer = self.processor.tokenizer
        expanded = []
        for ids, row_images in zip(prompt_ids, images):
            text = tokenizer.decode(ids, skip_special_tokens=False)
            full = self.processor(text=[text], images=[row_images], add_special_tokens=False)["input_ids"][0]
            expanded.append(list(full)[self.drop_prompt_tokens :])
        completions = [[11, 12, tokenizer.eos_token_id] for _ in prompt_ids]
        return {"prompt_ids": expanded, "completion_ids": completions, "logprobs": [[-1.0] * 3 for _ in prompt_ids]}


def _trainer_with_stand_in(tmp_path, seen, drop_prompt_tokens=0):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        vllm_importance_sampling_correction=False,
    )
    data = load_test_dataset("vision_conversational_prompt_only", "train")
    name = "tiny-Qwen2VLForConditionalGeneration"
    trainer = GRPOTrainer(
        model=get_model_path(name), reward_funcs=recording_image_reward(seen), args=args, train_dataset=data
    )
    trainer.vllm_generation = _StandInVLLM(trainer.processing_class, drop_prompt_tokens)
    return trainer


@requires_qwen2_vl_processor
def test_vllm_receives_unexpanded_placeholders_and_images_per_row(tmp_path):
    seen = []
    trainer = _trainer_with_stand_in(tmp_path, seen)
    trainer.train()
    prompt_ids, images = trainer.vllm_generation.calls[0]
    image_token = trainer.processing_class.image_token_id
    assert len(prompt_ids) == len(images) == 4
    # One placeholder per image: vLLM's processor expands it.
    assert all(ids.count(image_token) == len(row) == 1 for ids, row in zip(prompt_ids, images))
    # The rows of a group carry the same image, the one the rewards receive.
    assert images[0][0].tobytes() == images[1][0].tobytes() != images[2][0].tobytes()
    assert [row[0].tobytes() for row in seen[0][2]] == [row[0].tobytes() for row in images]
    log = train_logs(trainer)[-1]
    assert log["completions/mean_length"] == 3


@requires_qwen2_vl_processor
def test_vllm_prompt_expanded_differently_fails_clearly(tmp_path):
    trainer = _trainer_with_stand_in(tmp_path, [], drop_prompt_tokens=1)
    with pytest.raises(RuntimeError, match="vLLM expanded the image placeholders"):
        trainer.train()


def test_server_turns_json_logit_bias_keys_into_token_ids():
    from trl.scripts._vllm_engines import _sampling_params

    request = dict(n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=4)
    request.update(logprobs=0, generation_kwargs={"logit_bias": {"7": -100}})
    assert _sampling_params(request, dict)["logit_bias"] == {7: -100.0}


# ---------------------------------------------------------------------------------------------------------------------
# vLLM environment
# ---------------------------------------------------------------------------------------------------------------------
def _train_and_check(trainer_class, config_class, name, tmp_path, importance_sampling=True, **overrides):
    """Train on image prompts through vLLM; the rewards see each row's image and the log-probs match vLLM's."""
    seen = []
    data = load_test_dataset("vision_conversational_prompt_only", "train")
    args = online_args(config_class, tmp_path, max_steps=2, max_completion_length=6, **overrides)
    trainer = trainer_class(
        model=get_model_path(name), reward_funcs=recording_image_reward(seen), args=args, train_dataset=data
    )
    assert trainer.vllm_generation.suppress_token_ids == [trainer.processing_class.image_token_id]
    before = snapshot(trainer.model)
    try:
        trainer.train()
    finally:
        trainer.end()
    assert changed_params(before, trainer.model)
    assert_rewards_saw_group_images(seen)
    logs = train_logs(trainer)
    assert len(logs) == 2
    for log in logs:
        assert "rewards/image_reward/mean" in log and 0 < log["completions/max_length"] <= 6
        if importance_sampling:
            # vLLM sampled from the same expanded prompt, pixels and (pushed) weights the trainer scores with.
            assert log["sampling/sampling_logp_difference/max"] < 1e-3, log
    return trainer


@pytest.mark.vllm
@requires_vllm
def test_grpo_colocate_with_images(tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    trainer = _train_and_check(GRPOTrainer, GRPOConfig, "tiny-Idefics3ForConditionalGeneration", tmp_path)
    assert trainer.vllm_generation.mode == "colocate"


@pytest.mark.vllm
@requires_vllm
def test_rloo_colocate_with_images(tmp_path):
    from trl import RLOOConfig, RLOOTrainer

    # RLOO has no importance-sampling correction.
    name = "tiny-Idefics3ForConditionalGeneration"
    _train_and_check(RLOOTrainer, RLOOConfig, name, tmp_path, importance_sampling=False, beta=0.0)


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize(
    "name, server_args",
    [
        ("tiny-Idefics3ForConditionalGeneration", ()),
        # vLLM's own LLaVA implementation imports torchvision; its transformers backend does not. That backend patches
        # transformers' classes in the process that loads it, so it only runs apart from the trainer (server mode).
        ("tiny-LlavaForConditionalGeneration", ("--vllm_model_impl", "transformers")),
    ],
)
def test_grpo_server_mode_with_images(tmp_path, name, server_args):
    from trl import GRPOConfig, GRPOTrainer

    with running_server(get_model_path(name), tmp_path / "server.log", *server_args) as (_, port):
        trainer = _train_and_check(
            GRPOTrainer,
            GRPOConfig,
            name,
            tmp_path,
            vllm_mode="server",
            vllm_server_base_url=f"http://127.0.0.1:{port}",
            vllm_group_port=free_port(),
            vllm_server_timeout=30,
        )
    assert trainer.vllm_generation.mode == "server"

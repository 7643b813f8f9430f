"""GRPO and RLOO generating from image prompts through vLLM (run in the vLLM environment: `make test-vllm`).

vLLM receives each prompt's token ids with one placeholder per image plus the images as multi-modal data, and expands
the placeholders with its own processor; the trainer checks the expanded prompt is the one its processor trains on.
Layouts: image tiles (Idefics3, vLLM's own implementation) in colocate and server mode, fixed-size images (LLaVA,
vLLM's transformers backend) in server mode. The grid layout (Qwen2-VL) needs torchvision in vLLM, absent here.
"""

import pytest
from vllm_utils import free_port, running_server

from trl.assets import get_model_path, load_test_dataset
from trl.import_utils import is_vllm_available


requires_vllm = pytest.mark.skipif(
    not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)"
)
pytest.importorskip("PIL")


def _online_args(config_class, tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=256,
    )
    values.update(overrides)
    return config_class(**values)


def _train_and_check(trainer_class, config_class, name, tmp_path, importance_sampling=True, **overrides):
    """Train on image prompts through vLLM; the rewards see each row's image and the log-probs match vLLM's."""
    import torch

    seen = []

    def image_reward(prompts, completions, images, **kwargs):
        seen.append((prompts, completions, images))
        # Depends on the image (brighter top-left pixel, higher reward) and on the completion (so groups differ).
        return [
            float(sum(row[0].getpixel((0, 0)))) / 765.0 + 0.01 * len(completion[0]["content"])
            for row, completion in zip(images, completions)
        ]

    data = load_test_dataset("vision_conversational_prompt_only", "train")
    args = _online_args(config_class, tmp_path, **overrides)
    trainer = trainer_class(model=get_model_path(name), reward_funcs=image_reward, args=args, train_dataset=data)
    image_token = trainer.processing_class.image_token_id
    assert trainer.vllm_generation.suppress_token_ids == [image_token]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        trainer.train()
    finally:
        trainer.end()
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    prompts, completions, images = seen[0]
    assert len(completions) == len(images) == 4
    # The two completions of a group share the prompt's image, the next group has another one.
    assert images[0][0].tobytes() == images[1][0].tobytes()
    assert images[0][0].tobytes() != images[2][0].tobytes()
    assert prompts[0][0]["content"][0]["image"] is images[0][0]
    logs = [log for log in trainer.state.log_history if "loss" in log]
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

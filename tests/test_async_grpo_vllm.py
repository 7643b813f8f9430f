"""AsyncGRPO against a real `trl vllm-serve` (CPU vLLM): rollouts through `VLLMServeBackend`, weight pushes through
`VLLMServeWeightTransfer` (the gloo weight-sync group). Runs in the vLLM environment (`make test-vllm`)."""

import pytest
import torch
from datasets import Dataset
from vllm_utils import running_server

from trl.assets import get_model_path
from trl.import_utils import is_vllm_available


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)"),
]


def even_first_token(completion_ids, **kwargs):
    return [1.0 if ids and ids[0] % 2 == 0 else 0.0 for ids in completion_ids]


@pytest.mark.timeout(900)
def test_async_grpo_trains_against_vllm_serve(tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    model_path = get_model_path("tiny-Qwen2ForCausalLM")
    with running_server(model_path, tmp_path / "server.log") as (client, port):
        args = AsyncGRPOConfig(
            str(tmp_path / "out"), use_cpu=True, max_steps=3, per_device_train_batch_size=4, num_generations=4,
            max_completion_length=8, token_budget=256, learning_rate=1e-3, report_to="none", save_strategy="no",
            vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_server_timeout=60,
        )  # fmt: skip
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(4)]})
        trainer = AsyncGRPOTrainer(model_path, reward_funcs=even_first_token, args=args, train_dataset=dataset)
        before = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
        trainer.train()
        assert trainer.model_version == 4  # initial sync + one per step
        assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
        logged = {key for entry in trainer.state.log_history for key in entry}
        assert {"reward", "ratio", "perf/weight_sync_s", "rollout/generated_tok_s"} <= logged
        # The server samples from the trained weights: its log-probabilities match the trainer's (float32, eager).
        assert abs(trainer.state.log_history[-2]["ratio"] - 1.0) < 0.2

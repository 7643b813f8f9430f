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


def _lora_trainer(tmp_path, model_path, url, max_steps):
    """An AsyncGRPO trainer of a rank-8 LoRA policy (q/v projections) against the server at `url`."""
    import peft

    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(
        str(tmp_path / "out"), use_cpu=True, max_steps=max_steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, token_budget=256, learning_rate=5e-2, report_to="none", save_strategy="no",
        vllm_server_base_url=url, vllm_server_timeout=60, max_staleness=1,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(4)]})
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    trainer = AsyncGRPOTrainer(
        model_path, reward_funcs=even_first_token, args=args, train_dataset=dataset, peft_config=lora
    )
    return trainer, lora


@pytest.mark.timeout(900)
def test_async_grpo_lora_adapter_sync_against_vllm_serve(tmp_path):
    """The issue's acceptance test: a PEFT policy is synced adapter-only (no merge, no weight group), the server
    generates with the loaded adapter, and its log-probs of a fixed sequence equal the merged policy's."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    from vllm_utils import trainer_logps

    model_path = get_model_path("tiny-Qwen2ForCausalLM")
    lora_flags = ("--enable_lora", "--max_lora_rank", "8", "--max_loras", "4")
    with running_server(model_path, tmp_path / "server.log", *lora_flags) as (client, port):
        assert client.get_server_info()["lora_config"]["max_lora_rank"] == 8
        trainer, lora = _lora_trainer(tmp_path, model_path, f"http://127.0.0.1:{port}", max_steps=3)
        assert trainer._adapter_sync
        trainer.train()
        assert trainer.model_version == 4  # initial sync + one per step, each an adapter
        logged = {key for entry in trainer.state.log_history for key in entry}
        assert {"reward", "ratio", "perf/weight_sync_s", "rollout/generated_tok_s"} <= logged
        # Versions 3 and 4 stay loaded (max_staleness=1); version 2 was unloaded, version 1's directory deleted.
        assert sorted(p.name for p in (tmp_path / "out" / ".vllm_lora").iterdir()) == [
            "trl-policy-v2", "trl-policy-v3", "trl-policy-v4",
        ]  # fmt: skip
        output = client.generate([[1, 2, 3]], max_tokens=4, lora_name="trl-policy-v4")
        assert len(output["completion_ids"][0]) > 0
        with pytest.raises(RuntimeError, match="cannot be found"):
            client.generate([[1, 2, 3]], max_tokens=4, lora_name="trl-policy-v2")

        # The merged policy: the tiny model plus the trainer's adapter, merged, in plain (sdpa) attention.
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        merged = peft.get_peft_model(base, lora)
        peft.set_peft_model_state_dict(merged, peft.get_peft_model_state_dict(trainer.model))
        merged = merged.merge_and_unload().eval()
        sequence = list(range(10, 40))
        prompt, completion = sequence[:5], sequence[5:]
        expected = torch.tensor(trainer_logps(merged, prompt, completion))
        scored = client.get_sequence_logprobs([sequence], [5], top_logprobs=1, lora_name="trl-policy-v4")
        with_adapter = torch.tensor(scored["actual_logprobs"][0])
        without = torch.tensor(client.get_sequence_logprobs([sequence], [5], top_logprobs=1)["actual_logprobs"][0])
        gap = (without - expected).abs().max().item()
        assert gap > 1e-3, f"the trained adapter should move the log-probs (base vs merged: {gap})"
        torch.testing.assert_close(with_adapter, expected, rtol=0, atol=1e-4)


@pytest.mark.timeout(900)
def test_async_grpo_lora_adapter_sync_against_plain_vllm_serve(tmp_path, monkeypatch):
    """TRL's setup: a plain `vllm serve --enable-lora` student server; adapters loaded with vLLM's own runtime-LoRA
    routes, rollouts through `/v1/completions` with `model=trl-policy-v{N}`, no weight-transfer engine."""
    pytest.importorskip("peft")
    import requests
    from vllm_utils import running_openai_server

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    model_path = get_model_path("tiny-Qwen2ForCausalLM")
    flags = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "4")
    with running_openai_server(model_path, tmp_path / "server.log", *flags) as url:
        trainer, _ = _lora_trainer(tmp_path, model_path, url, max_steps=2)
        assert trainer._adapter_sync
        trainer.train()
        assert trainer.model_version == 3
        served = {model["id"] for model in requests.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert {"trl-policy-v2", "trl-policy-v3"} <= served and "trl-policy-v1" not in served
        assert any("reward" in entry for entry in trainer.state.log_history)


@pytest.mark.timeout(900)
def test_async_grpo_example_script_against_vllm_serve(tmp_path, monkeypatch):
    """`examples/scripts/async_grpo.py` as its docstring runs it offline: `trl vllm-serve` on the tiny model, the
    script on its GSM8K-style questions; it trains, syncs and saves."""
    import os
    import runpy
    import sys

    model_path = get_model_path("tiny-Qwen2ForCausalLM")
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "scripts")
    script = os.path.join(script, "async_grpo.py")
    with running_server(model_path, tmp_path / "server.log") as (_, port):
        argv = [script, "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--num_generations", "4"]
        argv += ["--per_device_train_batch_size", "4", "--max_completion_length", "16", "--token_budget", "512"]
        argv += ["--use_cpu", "true", "--report_to", "none", "--save_strategy", "no"]
        argv += ["--vllm_server_base_url", f"http://127.0.0.1:{port}", "--vllm_server_timeout", "60"]
        monkeypatch.setattr(sys, "argv", argv)
        runpy.run_path(script, run_name="__main__")
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "out"))

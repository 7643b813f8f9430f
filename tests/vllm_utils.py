"""Helpers shared by the vLLM test modules (run in the vLLM environment): a `trl vllm-serve` subprocess on a free
port of 127.0.0.1, started on the tiny model in eager float32 mode with a 1 GiB KV cache and stopped by PID."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from trl.import_utils import is_vllm_available


STARTUP_TIMEOUT_S = 300
# vLLM runs only in its own environment (`make test-vllm`); elsewhere these tests are skipped with this reason.
requires_vllm = pytest.mark.skipif(
    not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)"
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        # The server runs in its own session: take down the engine processes it spawned with it.
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@contextlib.contextmanager
def running_openai_server(model_path: str, log_path, *extra_args: str):
    """Start vLLM's own OpenAI server (what `vllm serve` runs) on a free port of 127.0.0.1; yield its base URL."""
    import requests

    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--enforce-eager",
        "--dtype", "float32",
        "--max-model-len", "256",
        *extra_args,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.exceptions.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not come up in {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        stop_server(process)


@contextlib.contextmanager
def running_server(model_path: str, log_path, *extra_args: str):
    """Start `trl vllm-serve` on a free port of 127.0.0.1, yield `(connected client, port)`, stop the server by PID."""
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    command = [
        sys.executable, "-m", "trl.cli.main", "vllm-serve",
        "--model", model_path,
        "--port", str(port),
        "--enforce_eager",
        "--dtype", "float32",
        "--max_model_len", "512",
        "--log_level", "warning",
        *extra_args,
    ]  # fmt: skip
    if not torch.cuda.is_available():
        # On CPU this fraction is checked against free host memory: keep it small on shared machines.
        command += ["--gpu_memory_utilization", "0.1"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        from trl.generation.vllm_client import VLLMClient

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        client = None
        while client is None:
            if process.poll() is not None:
                pytest.fail(f"vllm-serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                client = VLLMClient(host="127.0.0.1", server_port=port, connection_timeout=0.0)
            except ConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm-serve did not come up in {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")
                time.sleep(2)
        yield client, port
    finally:
        stop_server(process)


def trainer_logps(model, prompt: list[int], completion: list[int]) -> list[float]:
    """The trainer's per-token log-probs of `completion` after `prompt` (`compute_token_logps`, temperature 1)."""
    from trl.trainer.utils import compute_token_logps

    input_ids = torch.tensor([prompt + completion])
    target_mask = torch.zeros(1, input_ids.shape[1] - 1, dtype=torch.bool)
    target_mask[0, len(prompt) - 1 :] = True
    with torch.no_grad():
        logps = compute_token_logps(model, input_ids, target_mask=target_mask).logps
    return logps[0, len(prompt) - 1 :].tolist()


def online_args(config_class, tmp_path, **overrides):
    """An online trainer config generating with a colocated vLLM engine (3 short steps, small KV cache), or with the
    server given in `overrides` (`vllm_mode="server"`: the in-process engine's settings are left out)."""
    values = dict(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=256,
    )
    if overrides.get("vllm_mode") == "server":  # they configure no server; the trainers warn that they are unused
        del values["vllm_gpu_memory_utilization"], values["vllm_max_model_length"]
    values.update(overrides)
    return config_class(**values)

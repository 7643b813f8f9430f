"""Client of a plain `vllm serve` student server for the asynchronous trainers (rank 0 only).

Readiness, limits and configuration (`/health`, `/v1/models`, `/server_info`), the world size, pausing generation, the
native weight-transfer endpoints of vLLM (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) and runtime LoRA adapters (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`). The server is
started with `VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "nccl"}'` (plus
`--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` for adapter-only sync).
"""

from __future__ import annotations

import time
from typing import Any

from ...generation.vllm_client import fetch_server_info
from ...import_utils import is_requests_available


if is_requests_available():
    import requests
else:  # pragma: no cover - exercised only without requests
    requests = None


__all__ = ["VLLMClient"]


class VLLMClient:
    """HTTP client of a `vllm serve` server (blocking calls, one `requests` session).

    Args:
        server_url: Base URL of the server, for example `"http://localhost:8000"`.
        server_timeout: Seconds [`wait_for_server_ready`] waits for `/health`.

    Raises:
        ImportError: When `requests` is not installed.
    """

    def __init__(self, server_url: str, server_timeout: float = 240.0):
        if requests is None:
            raise ImportError("The async VLLMClient needs `requests`: `pip install requests` (or `trl[vllm]`).")
        self.server_url = server_url.rstrip("/")
        self.server_timeout = server_timeout
        self.session = requests.Session()

    def _request(self, method: str, path: str, timeout: float, **kwargs: Any) -> Any:
        response = self.session.request(method, f"{self.server_url}{path}", timeout=timeout, **kwargs)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server request {method} {path} failed: {response.status_code}, {response.text}")
        return response.json() if response.content else None

    def wait_for_server_ready(self, poll_interval_s: float = 2.0) -> None:
        """Poll `/health` until it answers 200; `TimeoutError` after `server_timeout` seconds."""
        deadline = time.monotonic() + self.server_timeout
        while True:
            try:
                if self.session.get(f"{self.server_url}/health", timeout=max(poll_interval_s, 1.0)).status_code == 200:
                    return
            except requests.exceptions.RequestException:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"The vLLM server at {self.server_url} did not become ready within {self.server_timeout} s. Start "
                    "it with `VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config "
                    '\'{"backend": "nccl"}\'` or raise vllm_server_timeout.'
                )
            time.sleep(poll_interval_s)

    def get_max_model_len(self) -> int:
        """The served model's context length (`/v1/models`)."""
        return int(self._request("GET", "/v1/models", 30)["data"][0]["max_model_len"])

    def get_server_info(self) -> dict:
        """vLLM's configuration tree (`/server_info?config_format=json`; needs `VLLM_SERVER_DEV_MODE=1`)."""
        return fetch_server_info(self.session, self.server_url, timeout=30)

    def get_dtype(self) -> str:
        """The served weights' dtype as vLLM writes it (for example `"torch.bfloat16"`)."""
        return str(self.get_server_info()["model_config"]["dtype"])

    def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: int = 1800) -> None:
        """Load an adapter saved at `lora_path` under the model name `lora_name`."""
        response = self.session.post(
            f"{self.server_url}/v1/load_lora_adapter",
            json={"lora_name": lora_name, "lora_path": lora_path, "load_inplace": False},
            timeout=timeout,
        )
        if response.status_code == 404:
            raise RuntimeError(
                "The vLLM server cannot load LoRA adapters at runtime: start it with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1."
            )
        if response.status_code != 200:
            raise RuntimeError(f"Loading LoRA adapter {lora_name} failed: {response.status_code}, {response.text}")

    def unload_lora_adapter(self, lora_name: str, timeout: int = 1800) -> None:
        """Unload the adapter `lora_name` (errors are ignored: it may already be gone)."""
        try:
            self.session.post(
                f"{self.server_url}/v1/unload_lora_adapter", json={"lora_name": lora_name}, timeout=timeout
            )
        except requests.exceptions.RequestException:
            pass

    def get_world_size(self) -> int:
        """Number of vLLM workers holding weights (the weight-transfer group adds one trainer rank)."""
        return int(self._request("GET", "/get_world_size", 30)["world_size"])

    def pause(self, timeout: int = 1800) -> None:
        """Pause generation, keeping requests in flight (`/pause?mode=keep`)."""
        self._request("POST", "/pause", timeout, params={"mode": "keep"})

    def resume(self, timeout: int = 1800) -> None:
        """Resume generation."""
        self._request("POST", "/resume", timeout)

    def init_weight_transfer_engine(self, init_info: dict, timeout: int = 1800) -> None:
        """Open the server side of the weight-transfer group."""
        self._request("POST", "/init_weight_transfer_engine", timeout, json={"init_info": init_info})

    def start_weight_update(self, timeout: int = 1800) -> None:
        """Begin a weight update (checkpoint-format names)."""
        self._request("POST", "/start_weight_update", timeout, json={"is_checkpoint_format": True})

    def update_weights(self, update_info: dict, timeout: int = 1800) -> None:
        """Receive the tensors described by `update_info` (names, dtype names, shapes) over the group."""
        self._request("POST", "/update_weights", timeout, json={"update_info": update_info})

    def finish_weight_update(self, timeout: int = 1800) -> None:
        """End a weight update."""
        self._request("POST", "/finish_weight_update", timeout)

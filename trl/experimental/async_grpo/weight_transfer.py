"""Weight transfer from the trainer (rank 0) to a `vllm serve` student server over vLLM's native NCCL engine.

The server's workers join an NCCL group with the trainer as rank 0 (`--weight-transfer-config '{"backend": "nccl"}'`);
each sync pauses generation, starts an update, broadcasts every tensor while the server's `/update_weights` receives
them, finishes and resumes. GPU only (NCCL); needs vLLM installed in the trainer's environment.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from ...import_utils import is_vllm_available
from .vllm_client import VLLMClient


__all__ = ["WeightTransferClient"]

_CONTROL_TIMEOUT_S = 300


class WeightTransferClient:
    """Push `(name, tensor)` pairs to a `vllm serve` server through its NCCL weight-transfer engine.

    Args:
        vllm_client: Client of the server.
        weight_update_info: Manifest of the tensors of one sync: `names`, `dtype_names`, `shapes` (built once).
        weight_sync_timeout: Seconds allowed for one `/update_weights` call.

    Raises:
        ImportError: When vLLM is not installed.
    """

    def __init__(self, vllm_client: VLLMClient, weight_update_info: dict, weight_sync_timeout: int = 1800):
        if not is_vllm_available():
            raise ImportError("WeightTransferClient needs vLLM in the trainer's environment: `pip install trl[vllm]`.")
        self.vllm_client = vllm_client
        self.weight_update_info = dict(weight_update_info)
        self.weight_sync_timeout = weight_sync_timeout
        self._group: Any = None

    def init_weight_transfer(self) -> None:
        """Wait for the server, warn on a dtype mismatch, and open the NCCL group (trainer = rank 0)."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.network_utils import get_ip, get_open_port

        client = self.vllm_client
        client.wait_for_server_ready()
        dtypes = Counter(self.weight_update_info.get("dtype_names", []))
        if dtypes:
            trained = dtypes.most_common(1)[0][0]
            served = client.get_dtype().replace("torch.", "")
            if served != trained:
                warnings.warn(
                    f"The vLLM server holds {served} weights but the trainer sends {trained}: pushed weights are cast "
                    "by the server, so sampler and trainer log-probabilities differ more. Start the server with "
                    f"--dtype {trained}.",
                    UserWarning,
                    stacklevel=2,
                )
        world_size = client.get_world_size() + 1
        init_info = {
            "master_address": get_ip(),
            "master_port": get_open_port(),
            "rank_offset": 1,
            "world_size": world_size,
            "packed": False,
        }
        result: dict[str, Any] = {}

        def open_group() -> None:
            try:
                group = StatelessProcessGroup.create(
                    host=init_info["master_address"], port=init_info["master_port"], rank=0, world_size=world_size
                )
                result["group"] = PyNcclCommunicator(group, device=torch.cuda.current_device())
            except Exception as error:  # surfaced below, on the caller's thread
                result["error"] = error

        thread = threading.Thread(target=open_group, daemon=True)
        thread.start()
        client.init_weight_transfer_engine(init_info, timeout=_CONTROL_TIMEOUT_S)
        thread.join()
        if "error" in result:
            raise RuntimeError(f"Opening the NCCL weight-transfer group failed: {result['error']}") from result[
                "error"
            ]
        self._group = result["group"]

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast every tensor of `iterator` (in manifest order) while the server receives them."""
        if self._group is None:
            raise RuntimeError("Call init_weight_transfer() before send_weights().")
        client = self.vllm_client
        client.start_weight_update(timeout=_CONTROL_TIMEOUT_S)
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                client.update_weights({**self.weight_update_info, "packed": False}, timeout=self.weight_sync_timeout)
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        try:
            stream = torch.cuda.current_stream()
            for _, tensor in iterator:
                self._group.broadcast(tensor.contiguous(), src=0, stream=stream)
            stream.synchronize()
            thread.join()
            if errors:
                raise RuntimeError(f"The server failed to receive the weights: {errors[0]}") from errors[0]
        finally:
            client.finish_weight_update(timeout=_CONTROL_TIMEOUT_S)

    def pause(self) -> None:
        """Pause the server's generation."""
        self.vllm_client.pause(timeout=_CONTROL_TIMEOUT_S)

    def resume(self) -> None:
        """Resume the server's generation."""
        self.vllm_client.resume(timeout=_CONTROL_TIMEOUT_S)

    def destroy(self) -> None:
        """Drop the NCCL group."""
        self._group = None

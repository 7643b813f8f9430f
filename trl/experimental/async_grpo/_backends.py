"""Generation backends of the rollout worker and the weight transfer that goes with them.

The rollout worker only needs a [`GenerationBackend`]: something that checks it can serve and samples completions of
token-id prompts with the sampler's log-probabilities. Production runs use [`VLLMServeBackend`], which talks to
`trl vllm-serve` through the existing [`~trl.generation.vllm_client.VLLMClient`], and [`VLLMServeWeightTransfer`],
which pushes weights to the same server over the client's weight-sync group. Tests inject an in-process backend.

TRL 1.16 talks to a plain `vllm serve` (OpenAI `/v1/completions`, NCCL weight transfer engine); its clients are
`async_grpo.vllm_client.VLLMClient` and `async_grpo.weight_transfer.WeightTransferClient`, which the trainer does not
build by default yet (see `docs/async_grpo.md`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch


__all__ = [
    "GenerationBackend",
    "OpenAICompletionsBackend",
    "PauseResumeTransfer",
    "VLLMServeBackend",
    "VLLMServeWeightTransfer",
    "is_plain_vllm_server",
]


@runtime_checkable
class GenerationBackend(Protocol):
    """What the rollout worker needs from a generation server."""

    def check_ready(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the backend; raise `ConnectionError` when it cannot be reached."""

    def generate(self, prompt_ids: list[int], n: int, sampling: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
        """Sample `n` completions of `prompt_ids`.

        Args:
            prompt_ids: The rendered prompt's token ids.
            n: Completions to sample.
            sampling: `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `model` (the
                served model's name, or the LoRA adapter's with adapter-only sync) and `lora_name` (the adapter to
                generate with, `None` for the served weights).

        Returns:
            One `(completion token ids, sampler log-probability of each of them)` pair per completion.
        """


class VLLMServeBackend:
    """[`GenerationBackend`] over a `trl vllm-serve` server, through [`~trl.generation.vllm_client.VLLMClient`].

    Args:
        client: A connected `VLLMClient`.
    """

    def __init__(self, client: Any):
        self.client = client

    def check_ready(self, timeout: float) -> None:
        self.client.check_server(timeout)

    def generate(self, prompt_ids: list[int], n: int, sampling: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
        lora = {"lora_name": sampling["lora_name"]} if sampling.get("lora_name") else {}
        output = self.client.generate(
            prompts=[list(prompt_ids)],
            n=n,
            repetition_penalty=sampling["repetition_penalty"],
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            top_k=sampling["top_k"],
            min_p=sampling.get("min_p") or 0.0,
            max_tokens=sampling["max_tokens"],
            logprobs=0,
            **lora,
        )
        completions = []
        for ids, logprobs in zip(output["completion_ids"], output["logprobs"], strict=True):
            # Per token: the sampled token's log-probability first, then the top others.
            completions.append((list(ids), [float(token[0]) for token in logprobs]))
        return completions


class VLLMServeWeightTransfer:
    """[`WeightTransferProtocol`] over `trl vllm-serve`'s weight-sync group (gloo on CPU, NCCL on GPU).

    `trl vllm-serve` applies pushed weights before its next generation, so `pause`/`resume` have nothing to do.

    Args:
        client: A connected `VLLMClient`.
    """

    def __init__(self, client: Any):
        self.client = client

    def init_weight_transfer(self) -> None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.client.init_communicator(device=device)

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        with self.client.weight_update():
            self.client.update_named_params(named_params=iterator)

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        self.client.close_communicator()


class PauseResumeTransfer:
    """[`WeightTransferProtocol`] of adapter-only sync to a plain `vllm serve`: generation is paused while the new
    adapter is saved and loaded; no weights travel (and no NCCL group, so the trainer needs neither vLLM nor a GPU).

    Args:
        client: An `async_grpo.vllm_client.VLLMClient` of the server.
    """

    def __init__(self, client: Any):
        self.client = client

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        self.client.pause()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        raise RuntimeError("Adapter-only sync pushes no full weights; the adapter is loaded by name instead.")

    def resume(self) -> None:
        self.client.resume()

    def destroy(self) -> None:
        pass


def is_plain_vllm_server(base_url: str, timeout: float = 10.0) -> bool:
    """Whether `base_url` is a plain `vllm serve` (OpenAI API, no `trl vllm-serve` endpoints), read from the endpoints
    it lists in `/openapi.json`. False when the server does not answer or lists no paths."""
    import requests

    try:
        response = requests.get(f"{base_url.rstrip('/')}/openapi.json", timeout=timeout)
    except requests.exceptions.RequestException:
        return False
    if response.status_code != 200:
        return False
    paths = {path.rstrip("/") for path in (response.json().get("paths") or {})}
    return "/v1/completions" in paths and "/generate" not in paths


class OpenAICompletionsBackend:
    """[`GenerationBackend`] over a plain `vllm serve` (TRL 1.16's student server): one `/v1/completions` request per
    completion, with the prompt as token ids, `return_token_ids` and the sampled tokens' log-probabilities.

    Args:
        base_url: The server's URL.
        request_timeout: Seconds per request.
        max_attempts: Attempts on transport errors (back-off `min(2^min(a, 4), 16)` seconds).
    """

    def __init__(self, base_url: str, request_timeout: float = 600.0, max_attempts: int = 30):
        import requests

        self.base_url = base_url.rstrip("/")
        self.request_timeout = request_timeout
        self.max_attempts = max_attempts
        self.session = requests.Session()
        self.retries = 0

    def check_ready(self, timeout: float) -> None:
        from .vllm_client import VLLMClient

        try:
            VLLMClient(self.base_url, server_timeout=timeout).wait_for_server_ready()
        except TimeoutError as error:
            raise ConnectionError(str(error)) from error

    def get_max_model_len(self) -> int:
        from .vllm_client import VLLMClient

        return VLLMClient(self.base_url).get_max_model_len()

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        import time

        import requests

        for attempt in range(self.max_attempts):
            try:
                response = self.session.post(
                    f"{self.base_url}/v1/completions", json=payload, timeout=self.request_timeout
                )
            except requests.exceptions.RequestException:
                self.retries += 1
                if attempt + 1 == self.max_attempts:
                    raise
                time.sleep(min(2 ** min(attempt, 4), 16))
                continue
            if response.status_code != 200:
                raise RuntimeError(f"vLLM /v1/completions failed: {response.status_code}, {response.text}")
            return response.json()
        raise RuntimeError("unreachable")

    def generate(self, prompt_ids: list[int], n: int, sampling: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
        import random

        completions = []
        for _ in range(n):
            payload = {
                "model": sampling["model"],
                "prompt": list(prompt_ids),
                "max_tokens": sampling["max_tokens"],
                "temperature": sampling["temperature"],
                "top_p": sampling["top_p"],
                "top_k": sampling["top_k"] if sampling["top_k"] else -1,
                "repetition_penalty": sampling["repetition_penalty"],
                "n": 1,
                "return_token_ids": True,
                "logprobs": 0,
                "seed": random.getrandbits(63),
            }
            if sampling.get("min_p") is not None:
                payload["min_p"] = sampling["min_p"]
            choice = self._post(payload)["choices"][0]
            logprobs = [float(lp) for lp in (choice.get("logprobs") or {}).get("token_logprobs") or []]
            completions.append((list(choice["token_ids"]), logprobs))
        return completions

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


__all__ = ["GenerationBackend", "VLLMServeBackend", "VLLMServeWeightTransfer"]


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
            sampling: `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `model`.

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

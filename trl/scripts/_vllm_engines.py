"""The engine processes of `trl vllm-serve`: one `vllm.LLM` per data-parallel replica, each in its own spawned process.

`llm_worker` is the body of an engine process: it builds the engine (with the weight-sync worker extension of
`trl.generation.vllm_worker_extension`) and answers the commands the HTTP app (`trl.scripts._vllm_app`) sends through
its pipe. `_worker_environments` and `_parse_extra_args` prepare what `trl.scripts.vllm_serve.main` hands to each
process.
"""

import json
import logging
import math
import os
import traceback
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from .vllm_serve import ScriptArguments


logger = logging.getLogger(__name__)


def _finite(value: float) -> float | None:
    # JSON has no infinities: an impossible token (-inf) travels as null.
    return value if math.isfinite(value) else None


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
    if kwargs.get("logit_bias"):  # JSON object keys are strings; vLLM wants token ids
        kwargs["logit_bias"] = {int(token): float(bias) for token, bias in kwargs["logit_bias"].items()}
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


def _sequence_logprobs(llm, SamplingParams, request: dict, lora_request: Any = None) -> dict:
    sequences, prompt_lengths, top = request["sequences"], request["prompt_lengths"], request["top_logprobs"]
    if not sequences:
        return {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=top, detokenize=False)
    outputs = llm.generate(
        [{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False, lora_request=lora_request
    )
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


def _llm_kwargs(script_args: "ScriptArguments", extra_llm_kwargs: dict) -> dict:
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
        "worker_extension_cls": "trl.generation.vllm_worker_extension.WeightSyncWorkerExtension",
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


class _LoraAdapters:
    """The LoRA adapters an engine loaded at runtime, by name (vLLM identifies them by a positive integer id)."""

    def __init__(self, llm):
        self.llm = llm
        self.requests: dict[str, Any] = {}
        self.next_id = 1

    def load(self, lora_name: str, lora_path: str, load_inplace: bool = False) -> str:
        from vllm.lora.request import LoRARequest

        if lora_name in self.requests and not load_inplace:
            raise ValueError(f"The lora adapter '{lora_name}' has already been loaded.")
        if lora_name in self.requests:
            self.unload(lora_name)
        request = LoRARequest(lora_name=lora_name, lora_int_id=self.next_id, lora_path=lora_path)
        self.next_id += 1
        self.llm.llm_engine.add_lora(request)  # loads it now, so a bad path fails here and not at generation
        self.requests[lora_name] = request
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    def unload(self, lora_name: str) -> str:
        request = self.requests.pop(lora_name, None)
        if request is None:
            raise LookupError(f"The lora adapter '{lora_name}' cannot be found.")
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        return f"Success: LoRA adapter '{lora_name}' removed successfully."

    def get(self, lora_name: str | None) -> Any:
        """The `LoRARequest` of a loaded adapter (`None` for the base model)."""
        if lora_name is None:
            return None
        if lora_name not in self.requests:
            raise LookupError(f"The lora adapter '{lora_name}' cannot be found; load it with /v1/load_lora_adapter.")
        return self.requests[lora_name]


def llm_worker(
    script_args: "ScriptArguments", data_parallel_rank: int, environment: dict, extra_llm_kwargs: dict, connection
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
    connection.send({"status": "ready", "lora_config": _lora_config(llm)})
    try:
        _serve_engine_commands(llm, SamplingParams, data_parallel_rank, connection)
    finally:
        _shutdown_engine(llm)


def _lora_config(llm) -> dict | None:
    """The engine's LoRA settings as `/server_info` reports them (`None` without `--enable_lora`)."""
    config = getattr(getattr(llm.llm_engine, "vllm_config", None), "lora_config", None)
    if config is None:
        return None
    fields = ("max_lora_rank", "max_loras", "max_cpu_loras", "lora_dtype", "fully_sharded_loras")
    return {name: _jsonable(getattr(config, name, None)) for name in fields}


def _jsonable(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


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
    adapters = _LoraAdapters(llm)
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
                lora_request = adapters.get(request.get("lora_name"))
                outputs = llm.generate(command["prompts"], params, use_tqdm=False, lora_request=lora_request)
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
                    lora_request=adapters.get(request.get("lora_name")),
                )
                result = _format_outputs(outputs, request["logprobs"] is not None)
            elif op == "sequence_logprobs":
                request = command["request"]
                result = _sequence_logprobs(llm, SamplingParams, request, adapters.get(request.get("lora_name")))
            elif op == "load_lora_adapter":
                result = adapters.load(command["lora_name"], command["lora_path"], command.get("load_inplace", False))
            elif op == "unload_lora_adapter":
                result = adapters.unload(command["lora_name"])
            elif op == "reset_prefix_cache":
                result = llm.reset_prefix_cache()
            elif op == "collective_rpc":
                method = command["method"]
                if method in ("update_named_param", "update_named_params"):
                    weights_pending = True
                result = llm.collective_rpc(method, kwargs=command.get("kwargs") or {})
            else:
                raise ValueError(f"Unknown engine command {op!r}.")
        except LookupError as e:  # an unknown adapter name: the caller's mistake, no traceback
            result = {"error": f"{type(e).__name__}: {e.args[0] if e.args else e}"}
        except Exception as e:
            logger.exception("vLLM engine %d failed on %s", data_parallel_rank, op)
            result = {"error": f"{type(e).__name__}: {e}"}
        if command["type"] == "call":
            connection.send(result)


def _worker_environments(script_args: "ScriptArguments") -> list[dict]:
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

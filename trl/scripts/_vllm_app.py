"""The HTTP app of `trl vllm-serve` (FastAPI): requests are validated, split between the engine processes, and their
replies merged. See `trl.scripts.vllm_serve` for the endpoints and `trl.scripts._vllm_engines` for the engines.
"""

import base64
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ._vllm_engines import _finite


if TYPE_CHECKING:
    from .vllm_serve import ScriptArguments


def _decode_image(encoded: str):
    from PIL import Image

    if encoded.startswith("data:"):
        encoded = encoded.split(",", 1)[1]
    return Image.open(io.BytesIO(base64.b64decode(encoded))).convert("RGB")


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


def create_app(script_args: "ScriptArguments", engines: _Engines, lora_config: dict | None = None):
    """The FastAPI application serving `engines` (see `trl.scripts.vllm_serve` for the endpoints).

    Args:
        script_args: The server's options.
        engines: The engine processes' pipes.
        lora_config: The engines' LoRA settings (`max_lora_rank`, `max_loras`, ...), `None` when they run without
            LoRA; with them the app serves `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
    """
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
        lora_name: str | None = None

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
        lora_name: str | None = None

    class LoadLoraAdapterRequest(BaseModel):
        lora_name: str
        lora_path: str
        load_inplace: bool = False

    class UnloadLoraAdapterRequest(BaseModel):
        lora_name: str
        lora_int_id: int | None = None

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
                "structured_outputs_regex", "generation_kwargs", "lora_name",
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

    @app.get("/server_info")
    @app.get("/server_info/")
    def server_info(config_format: str = "json") -> dict:
        # The subset of vLLM's `/server_info` configuration tree that trainers read, from the server's own settings.
        return {
            "vllm_config": {
                "model_config": {
                    "model": script_args.model,
                    "dtype": script_args.dtype,
                    "max_model_len": script_args.max_model_len,
                    "logprobs_mode": "raw_logprobs",
                },
                "parallel_config": {
                    "tensor_parallel_size": script_args.tensor_parallel_size,
                    "data_parallel_size": script_args.data_parallel_size,
                },
                "lora_config": lora_config,
                "weight_transfer_config": None,
            }
        }

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
        fields = {"top_logprobs": request.top_logprobs, "lora_name": request.lora_name}
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

    if lora_config is not None:

        @app.post("/v1/load_lora_adapter")
        def load_lora_adapter(request: LoadLoraAdapterRequest) -> str:
            # vLLM's runtime-LoRA route: every engine loads the adapter, so any of them can generate with it.
            command = {"op": "load_lora_adapter", **request.model_dump()}
            return run([dict(command) for _ in engines.connections])[0]

        @app.post("/v1/unload_lora_adapter")
        def unload_lora_adapter(request: UnloadLoraAdapterRequest) -> str:
            try:
                replies = engines.call(
                    [{"op": "unload_lora_adapter", "lora_name": request.lora_name} for _ in engines.connections]
                )
            except RuntimeError as e:
                status = 404 if str(e).startswith("LookupError") else 400
                raise HTTPException(status_code=status, detail=str(e)) from e
            return replies[0]

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

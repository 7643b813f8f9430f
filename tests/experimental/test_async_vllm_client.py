"""`trl.experimental.async_grpo.vllm_client.VLLMClient` and `weight_transfer.WeightTransferClient` against a stub of
`vllm serve`'s endpoints (the HTTP boundary)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl.experimental.async_grpo._backends import OpenAICompletionsBackend, is_plain_vllm_server
from trl.experimental.async_grpo.vllm_client import VLLMClient
from trl.experimental.async_grpo.weight_transfer import WeightTransferClient
from trl.import_utils import is_vllm_available


class _Stub(BaseHTTPRequestHandler):
    calls: list = []
    lora_status = 200

    def log_message(self, *args):
        pass

    def _reply(self, status, payload=None):
        body = json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        type(self).calls.append(("GET", self.path, None))
        if self.path == "/openapi.json":
            return self._reply(200, {"paths": {"/health": {}, "/v1/models": {}, "/v1/completions": {}}})
        if self.path == "/health":
            return self._reply(200)
        if self.path == "/v1/models":
            return self._reply(200, {"data": [{"id": "m", "max_model_len": 321}]})
        if self.path == "/server_info?config_format=json":
            return self._reply(200, {"vllm_config": {"model_config": {"dtype": "torch.bfloat16"}}})
        if self.path == "/get_world_size":
            return self._reply(200, {"world_size": 2})
        return self._reply(404, {"detail": "Not Found"})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        payload = json.loads(self.rfile.read(length)) if length else None
        type(self).calls.append(("POST", self.path, payload))
        if self.path.startswith("/v1/load_lora_adapter"):
            return self._reply(type(self).lora_status, {"detail": "x"})
        if self.path == "/v1/completions":
            tokens = [7, 8, 9][: payload["max_tokens"]]
            choice = {"token_ids": tokens, "logprobs": {"token_logprobs": [-0.5] * len(tokens)}}
            return self._reply(200, {"choices": [choice]})
        return self._reply(200)


@pytest.fixture
def server():
    _Stub.calls, _Stub.lora_status = [], 200
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def test_endpoints(server):
    client = VLLMClient(server, server_timeout=5)
    client.wait_for_server_ready(poll_interval_s=0.1)
    assert client.get_max_model_len() == 321
    assert client.get_dtype() == "torch.bfloat16"
    assert client.get_world_size() == 2
    client.pause()
    client.resume()
    client.init_weight_transfer_engine({"world_size": 3})
    client.start_weight_update()
    client.update_weights({"names": ["w"]})
    client.finish_weight_update()
    client.load_lora_adapter("trl-policy-v1", "/tmp/a")
    client.unload_lora_adapter("trl-policy-v0")
    posts = [(path, payload) for method, path, payload in _Stub.calls if method == "POST"]
    assert posts == [
        ("/pause?mode=keep", None),
        ("/resume", None),
        ("/init_weight_transfer_engine", {"init_info": {"world_size": 3}}),
        ("/start_weight_update", {"is_checkpoint_format": True}),
        ("/update_weights", {"update_info": {"names": ["w"]}}),
        ("/finish_weight_update", None),
        ("/v1/load_lora_adapter", {"lora_name": "trl-policy-v1", "lora_path": "/tmp/a", "load_inplace": False}),
        ("/v1/unload_lora_adapter", {"lora_name": "trl-policy-v0"}),
    ]


def test_errors(server):
    _Stub.lora_status = 404
    client = VLLMClient(server, server_timeout=0.2)
    with pytest.raises(RuntimeError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        client.load_lora_adapter("a", "/tmp/a")
    with pytest.raises(TimeoutError, match="did not become ready"):
        VLLMClient("http://127.0.0.1:9", server_timeout=0.2).wait_for_server_ready(poll_interval_s=0.1)


@pytest.mark.skipif(is_vllm_available(), reason="checks the error raised without vLLM")
def test_weight_transfer_needs_vllm(server):
    with pytest.raises(ImportError, match="vLLM"):
        WeightTransferClient(VLLMClient(server), {"names": [], "dtype_names": [], "shapes": []})


def test_generation_through_a_plain_vllm_serve(server):
    assert is_plain_vllm_server(server) and not is_plain_vllm_server("http://127.0.0.1:9")
    backend = OpenAICompletionsBackend(server)
    backend.check_ready(5)
    assert backend.get_max_model_len() == 321
    sampling = {"model": "m", "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": None,
                "repetition_penalty": 1.0}  # fmt: skip
    out = backend.generate([1, 2, 3], 2, sampling)
    assert out == [([7, 8], [-0.5, -0.5])] * 2
    posted = [payload for method, path, payload in _Stub.calls if path == "/v1/completions"]
    assert len(posted) == 2 and posted[0]["prompt"] == [1, 2, 3] and posted[0]["n"] == 1
    assert posted[0]["return_token_ids"] and posted[0]["logprobs"] == 0 and posted[0]["top_k"] == -1
    assert "min_p" not in posted[0] and posted[0]["seed"] != posted[1]["seed"]


@pytest.mark.skipif(is_vllm_available(), reason="checks the error raised without vLLM")
def test_trl_setup_without_vllm_fails_before_training(server, tmp_path):
    """AsyncGRPO against a plain `vllm serve` (TRL's setup) picks the OpenAI backend and vLLM's weight transfer,
    which needs vLLM in the trainer's environment: a clear error when the trainer is built."""
    from datasets import Dataset

    from trl.assets import get_model_path
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, vllm_server_base_url=server.rstrip("/"))
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Hi"}]]})
    with pytest.raises(ImportError, match="vLLM"):
        AsyncGRPOTrainer(get_model_path("tiny-Qwen2ForCausalLM"), reward_funcs=lambda **k: [0.0], args=args,
                         train_dataset=dataset)  # fmt: skip

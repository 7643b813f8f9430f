"""`VLLMClient.get_server_info` and `image_features` against a stub HTTP server (the HTTP boundary), and
`trl.distributed.DistributedBackend` on a single-process accelerator."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from accelerate import Accelerator
from PIL import Image

from trl.distributed import DistributedBackend
from trl.generation.vllm_client import VLLMClient


class _Stub(BaseHTTPRequestHandler):
    server_info_status = 200
    render_status = 200
    rendered: list = []

    def log_message(self, *args):
        pass

    def _reply(self, status, payload):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/health"):
            return self._reply(200, {"status": "ok"})
        if self.path == "/server_info?config_format=json":
            config = {"model_config": {"model": "stub-model", "dtype": "torch.float32"}, "lora_config": None}
            return self._reply(self.server_info_status, {"vllm_config": config})
        return self._reply(404, {"detail": "not found"})

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/chat/completions/render":
            type(self).rendered.append(payload)
            count = len(payload["messages"][0]["content"])
            return self._reply(self.render_status, {"features": {"num_images": count}})
        return self._reply(404, {"detail": "not found"})


@pytest.fixture
def stub_server():
    server = HTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Stub.server_info_status, _Stub.render_status, _Stub.rendered = 200, 200, []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_get_server_info(stub_server):
    client = VLLMClient(base_url=stub_server)
    assert client.get_server_info()["model_config"]["dtype"] == "torch.float32"
    _Stub.server_info_status = 404
    with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
        client.get_server_info()
    _Stub.server_info_status = 500
    with pytest.raises(Exception, match="500"):
        client.get_server_info()


def test_image_features_one_request_per_prompt_with_images(stub_server):
    client = VLLMClient(base_url=stub_server)
    image = Image.new("RGB", (4, 4))
    features = client.image_features([[image, image], None, [image]], max_concurrent_requests=2)
    assert features == [{"num_images": 2}, None, {"num_images": 1}]
    assert len(_Stub.rendered) == 2
    request = _Stub.rendered[0]
    assert request["model"] == "stub-model" and request["max_tokens"] == 1
    assert request["messages"][0]["role"] == "user"
    assert request["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    _Stub.render_status = 404
    with pytest.raises(RuntimeError, match="enable-scale-out"):
        client.image_features([[image]])


def test_distributed_backend_single_process():
    backend = DistributedBackend(Accelerator(cpu=True))
    assert (backend.zero_stage, backend.fsdp_version, backend.is_zero3, backend.is_fsdp) == (0, None, False, False)
    with backend.gather_params([]), backend.summon_full_params(None):
        pass

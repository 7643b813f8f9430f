"""`VLLMClient.get_sequence_logprobs` against a plain `vllm serve` (OpenAI API): a stub HTTP server answering
`/v1/models` and `/v1/completions` with `prompt_logprobs` as vLLM does, backed by a tiny causal LM; and the choice of
route by the endpoints a server lists."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl.assets import get_model_path
from trl.generation.openai_scoring import parse_prompt_logprobs
from trl.generation.vllm_client import VLLMClient


class _OpenAIStub(BaseHTTPRequestHandler):
    model = None
    requests: list = []
    paths = {"/health": {}, "/v1/models": {}, "/v1/completions": {}}

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
        type(self).requests.append(("GET", self.path))
        path = self.path.rstrip("/")
        if path == "/health":
            return self._reply(200, {})
        if path == "/openapi.json":
            return self._reply(200, {"paths": type(self).paths})
        if path == "/v1/models":
            return self._reply(200, {"data": [{"id": "the-teacher", "max_model_len": 64}]})
        return self._reply(404, {"detail": "Not Found"})

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(("POST", self.path, payload))
        if self.path != "/v1/completions":
            return self._reply(404, {"detail": "Not Found"})
        k, choices = payload["prompt_logprobs"], []
        for index, ids in enumerate(payload["prompt"]):
            with torch.no_grad():
                log_probs = self.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            positions = [None]
            for position in range(1, len(ids)):
                row = log_probs[position - 1]
                order = row.argsort(descending=True).tolist()
                entry = {str(t): {"logprob": row[t].item(), "rank": r + 1} for r, t in enumerate(order[:k])}
                token = ids[position]
                entry.setdefault(str(token), {"logprob": row[token].item(), "rank": order.index(token) + 1})
                positions.append(entry)
            choices.append({"index": index, "text": "", "prompt_logprobs": positions})
        return self._reply(200, {"choices": choices[::-1]})  # out of order on purpose: the client sorts by index


@pytest.fixture(scope="module")
def tiny_model():
    return AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM")).eval()


@pytest.fixture
def openai_server(tiny_model):
    _OpenAIStub.model, _OpenAIStub.requests = tiny_model, []
    _OpenAIStub.paths = {"/health": {}, "/v1/models": {}, "/v1/completions": {}}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_scores_through_v1_completions(openai_server, tiny_model):
    client = VLLMClient(base_url=openai_server, connection_timeout=5)
    sequences, prompt_lengths = [[1, 2, 3, 4, 5], [7, 8, 9]], [2, 1]
    result = client.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs=3, temperature=2.0)
    posted = [r for r in _OpenAIStub.requests if r[0] == "POST"]
    assert posted == [
        (
            "POST",
            "/v1/completions",
            {"model": "the-teacher", "prompt": sequences, "max_tokens": 1, "temperature": 2.0, "prompt_logprobs": 3},
        )
    ]
    for row, (ids, start) in enumerate(zip(sequences, prompt_lengths)):
        with torch.no_grad():
            log_probs = tiny_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert len(result["logprobs"][row]) == len(ids) - start
        for t, position in enumerate(range(start, len(ids))):
            top = log_probs[position - 1].topk(3)
            assert result["logprob_token_ids"][row][t] == top.indices.tolist()
            assert result["logprobs"][row][t] == pytest.approx(top.values.tolist(), abs=1e-5)
            assert result["actual_logprobs"][row][t] == [
                pytest.approx(log_probs[position - 1, ids[position]].item(), abs=1e-5)
            ]
            assert result["actual_token_ids"][row][t] == [ids[position]]
    # Route and model name are read once.
    client.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs=1)
    gets = [r[1] for r in _OpenAIStub.requests if r[0] == "GET"]
    assert gets.count("/openapi.json") == 1 and gets.count("/v1/models") == 1


def test_trl_server_keeps_its_own_route(openai_server):
    _OpenAIStub.paths = {"/health/": {}, "/get_sequence_logprobs/": {}}
    client = VLLMClient(base_url=openai_server, connection_timeout=5)
    assert client._scoring_api() == "trl"


def test_parse_pads_missing_entries():
    choices = [{"index": 0, "prompt_logprobs": [None, {"5": {"logprob": -0.5, "rank": 1}}, None]}]
    out = parse_prompt_logprobs(choices, [[1, 5, 6]], [1], top_logprobs=2)
    assert out["logprob_token_ids"] == [[[5, 0], [0, 0]]]
    assert out["logprobs"][0][0][0] == -0.5 and math.isinf(out["logprobs"][0][0][1])
    assert out["actual_logprobs"][0][0] == [-0.5] and math.isinf(out["actual_logprobs"][0][1][0])
    with pytest.raises(ValueError, match="one choice per prompt"):
        parse_prompt_logprobs([], [[1, 2]], [1], top_logprobs=1)


def test_iw_opd_server_teacher_through_vllm_serve(openai_server, tmp_path, monkeypatch):
    """A TRL user's `vllm serve <teacher>` setup: IW-OPD's server teacher equals the same teacher held locally."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.assets import load_test_dataset
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer

    path = get_model_path("tiny-Qwen2ForCausalLM")
    data = load_test_dataset("conversational_language_modeling", split="train").select(range(4))
    common = dict(
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        max_length=96,
        max_completion_length=8,
    )
    server_args = IWOPDConfig(
        output_dir=str(tmp_path), use_teacher_server=True, teacher_model_server_url=openai_server, **common
    )
    student = get_model_path("small-Qwen2ForCausalLM")
    server = IWOPDTrainer(student, args=server_args, train_dataset=data)
    local = IWOPDTrainer(student, path, args=IWOPDConfig(output_dir=str(tmp_path), **common), train_dataset=data)
    batch = next(iter(local.get_train_dataloader()))
    expected = local.compute_loss(local.model, batch).item()
    assert expected != 0.0
    assert server.compute_loss(server.model, batch).item() == pytest.approx(expected, rel=1e-4)

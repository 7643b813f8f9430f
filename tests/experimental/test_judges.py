"""Judges: base-class contracts, AllTrueJudge, the chat-model pairwise judges against a local chat-completions stub
server, and PairRMJudge's dependency errors and verdict bookkeeping (with a stand-in for the `llm_blender` package)."""

import importlib.machinery
import json
import random
import re
import sys
import threading
import types
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import trl
from trl.experimental.judges import (
    AllTrueJudge,
    BaseBinaryJudge,
    BaseJudge,
    BasePairwiseJudge,
    BaseRankJudge,
    HfPairwiseJudge,
    OpenAIPairwiseJudge,
    PairRMJudge,
)
from trl.experimental.judges.judges import DEFAULT_PAIRWISE_SYSTEM_PROMPT
from trl.import_utils import _package_version, is_llm_blender_available, is_openai_available


# ---------------------------------------------------------------------------------------------------------------------
# Base classes
# ---------------------------------------------------------------------------------------------------------------------


class ShorterIsBetterJudge(BasePairwiseJudge):
    """Deterministic pairwise judge: the shorter completion wins, a tie is no verdict (-1)."""

    def judge(self, prompts, completions, shuffle_order=True):
        verdicts = []
        for first, second in completions:
            verdicts.append(-1 if len(first) == len(second) else int(len(second) < len(first)))
        return verdicts


class ConstantBinaryJudge(BaseBinaryJudge):
    def __init__(self, verdicts):
        self.verdicts = verdicts
        self.calls = []

    def judge(self, prompts, completions, gold_completions=None, shuffle_order=True):
        self.calls.append((prompts, completions, gold_completions, shuffle_order))
        return list(self.verdicts)


def test_bases_are_abstract():
    for base in (BaseJudge, BaseRankJudge, BasePairwiseJudge, BaseBinaryJudge):
        with pytest.raises(TypeError):
            base()
    assert issubclass(BasePairwiseJudge, BaseJudge)
    assert issubclass(BaseBinaryJudge, BaseJudge)
    assert not issubclass(BaseRankJudge, BaseJudge)
    for judge_class in (PairRMJudge, HfPairwiseJudge, OpenAIPairwiseJudge):
        assert issubclass(judge_class, BasePairwiseJudge)
    assert issubclass(AllTrueJudge, BaseBinaryJudge)


def test_custom_pairwise_judge_follows_the_contract():
    judge = ShorterIsBetterJudge()
    verdicts = judge.judge(["p1", "p2", "p3"], [["a", "bb"], ["ccc", "d"], ["ee", "ff"]])
    assert verdicts == [0, 1, -1]


def test_legacy_import_paths():
    from trl.trainer import judges as legacy

    assert legacy.PairRMJudge is PairRMJudge
    assert trl.OpenAIPairwiseJudge is OpenAIPairwiseJudge
    assert trl.trainer.AllTrueJudge is AllTrueJudge
    assert OpenAIPairwiseJudge.__module__ == "trl.experimental.judges.judges"
    # One list of names: the shim re-exports `trl.experimental.judges.__all__`, and the lazy index of `trl.trainer`
    # (which cannot import the judges to read it) names the same ones.
    assert legacy.__all__ is trl.experimental.judges.__all__
    assert sorted(trl.trainer._import_structure["judges"]) == sorted(legacy.__all__)
    assert all(getattr(legacy, name) is getattr(trl.experimental.judges, name) for name in legacy.__all__)
    assert legacy.DEFAULT_PAIRWISE_SYSTEM_PROMPT is DEFAULT_PAIRWISE_SYSTEM_PROMPT


# ---------------------------------------------------------------------------------------------------------------------
# AllTrueJudge
# ---------------------------------------------------------------------------------------------------------------------


def test_all_true_judge_combines_verdicts():
    first = ConstantBinaryJudge([1, 1, 0, 1, -1, 0])
    second = ConstantBinaryJudge([1, 0, 0, -1, 1, -1])
    judge = AllTrueJudge([first, second])
    prompts, completions, gold = ["p"] * 6, [f"c{i}" for i in range(6)], ["g"] * 6
    assert judge.judge(prompts, completions, gold, shuffle_order=False) == [1, 0, 0, -1, -1, -1]
    # Every judge sees the same arguments.
    assert first.calls == second.calls == [(prompts, completions, gold, False)]


def test_all_true_judge_bad_input():
    with pytest.raises(ValueError, match="at least one judge"):
        AllTrueJudge([])
    with pytest.raises(ValueError, match="returned 2"):
        AllTrueJudge([ConstantBinaryJudge([1, 1])]).judge(["p"] * 3, ["c"] * 3)
    with pytest.raises(ValueError, match="returned 2 for prompt 1"):
        AllTrueJudge([ConstantBinaryJudge([1, 2])]).judge(["p"] * 2, ["c"] * 2)


# ---------------------------------------------------------------------------------------------------------------------
# A local chat-completions server standing in for the judge model
# ---------------------------------------------------------------------------------------------------------------------

# Template used in the tests: easy for the stub to parse.
MARKED_PROMPT = "PROMPT<<{prompt}>>\nR0<<{response0}>>\nR1<<{response1}>>"
MARKED = re.compile(r"PROMPT<<(.*)>>\nR0<<(.*)>>\nR1<<(.*)>>", re.DOTALL)


class ChatCompletionsStub:
    """Chat-completions server on 127.0.0.1 whose "model" answers with the index of the longer response.

    Prompts containing "invalid" get a reply that is not an index. Requests are recorded; after `max_requests` the
    server answers 503, so a runaway client cannot loop forever.
    """

    def __init__(self, max_requests: int = 200):
        self.requests: list[dict] = []
        self.max_requests = max_requests
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if len(stub.requests) >= stub.max_requests:
                    self._send(503, {"error": {"message": "request budget of the stub exhausted"}})
                    return
                stub.requests.append({"path": self.path, "body": body})
                self._send(200, stub.completion(body))

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def answer(content: str) -> str:
        match = MARKED.fullmatch(content)
        if match is None:  # default system prompt: no parsing, always the first one
            return "0"
        prompt, response0, response1 = match.groups()
        if "invalid" in prompt:
            return "I cannot decide"
        return "1" if len(response1) > len(response0) else "0"

    def completion(self, body: dict) -> dict:
        content = body["messages"][-1]["content"]
        return {
            "id": f"stub-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "stub"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": self.answer(content)},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def shown_pairs(self) -> dict[str, tuple[str, str]]:
        """Prompt -> (response0, response1) as the judge model saw them."""
        shown = {}
        for request in self.requests:
            prompt, response0, response1 = MARKED.fullmatch(request["body"]["messages"][-1]["content"]).groups()
            shown[prompt] = (response0, response1)
        return shown

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def stub():
    server = ChatCompletionsStub()
    yield server
    server.stop()


@pytest.fixture
def openai_env(stub, monkeypatch):
    pytest.importorskip("openai")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{stub.url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    return stub


def pairs_with_known_winner(num: int):
    """Prompts and pairs where the longer completion (the stub's choice) is on a known side."""
    rng = random.Random(1234)
    prompts, completions, expected = [], [], []
    for i in range(num):
        short, long = f"s{i}", f"long answer {i}"
        winner = rng.randrange(2)
        prompts.append(f"question {i}")
        completions.append([short, long] if winner == 1 else [long, short])
        expected.append(winner)
    return prompts, completions, expected


# ---------------------------------------------------------------------------------------------------------------------
# OpenAIPairwiseJudge
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle_order", [True, False])
def test_openai_judge_returns_winners_in_the_callers_order(openai_env, shuffle_order):
    random.seed(0)
    prompts, completions, expected = pairs_with_known_winner(24)
    judge = OpenAIPairwiseJudge(model="judge-model", system_prompt=MARKED_PROMPT, max_requests=None)
    assert judge.judge(prompts, completions, shuffle_order=shuffle_order) == expected
    assert judge.num_requests == 24

    shown = openai_env.shown_pairs()
    swapped = [shown[prompt] == (pair[1], pair[0]) for prompt, pair in zip(prompts, completions)]
    assert all(shown[prompt] in ((pair[0], pair[1]), (pair[1], pair[0])) for prompt, pair in zip(prompts, completions))
    if shuffle_order:
        assert 0 < sum(swapped) < 24  # both orders were shown (a 2**-23 chance of failing with a fair coin)
    else:
        assert not any(swapped)
    for request in openai_env.requests:
        assert request["path"] == "/v1/chat/completions"
        body = request["body"]
        assert body["model"] == "judge-model"
        assert body["max_tokens"] == 1
        assert [m["role"] for m in body["messages"]] == ["user"]


def test_openai_judge_invalid_replies_are_minus_one_and_never_flipped(openai_env):
    random.seed(0)
    prompts = [f"invalid question {i}" for i in range(10)] + ["valid question"]
    completions = [["a", "bbbb"]] * 10 + [["cccc", "d"]]
    judge = OpenAIPairwiseJudge(system_prompt=MARKED_PROMPT)
    assert judge.judge(prompts, completions) == [-1] * 10 + [0]


def test_openai_judge_default_system_prompt(openai_env):
    judge = OpenAIPairwiseJudge()
    assert judge.model == "gpt-4-turbo-preview"
    assert judge.max_requests == 1000
    assert judge.system_prompt == DEFAULT_PAIRWISE_SYSTEM_PROMPT
    # The stub answers "0" to prompts it cannot parse: without shuffling that is completion 0.
    assert judge.judge(["What is 2 + 2?"], [["It is 4.", "It is 5."]], shuffle_order=False) == [0]
    content = openai_env.requests[0]["body"]["messages"][0]["content"]
    expected = DEFAULT_PAIRWISE_SYSTEM_PROMPT.format(
        prompt="What is 2 + 2?", response0="It is 4.", response1="It is 5."
    )
    assert content == expected
    assert '"""What is 2 + 2?"""' in content and '"""It is 5."""' in content


def test_openai_judge_request_budget(openai_env):
    prompts, completions, expected = pairs_with_known_winner(5)
    judge = OpenAIPairwiseJudge(system_prompt=MARKED_PROMPT, max_requests=3)
    with pytest.warns(UserWarning, match="budget of 3 requests"):
        assert judge.judge(prompts, completions, shuffle_order=False) == expected[:3] + [-1, -1]
    assert judge.num_requests == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is emitted once only
        assert judge.judge(prompts, completions) == [-1] * 5
    assert len(openai_env.requests) == 3
    with pytest.raises(ValueError, match="max_requests"):
        OpenAIPairwiseJudge(max_requests=-1)


def test_openai_judge_bad_input(openai_env):
    judge = OpenAIPairwiseJudge(system_prompt=MARKED_PROMPT)
    with pytest.raises(ValueError, match="2 prompts and 1 completion pairs"):
        judge.judge(["a", "b"], [["x", "y"]])
    with pytest.raises(ValueError, match=r"completions\[1\] is 3 completions"):
        judge.judge(["a", "b"], [["x", "y"], ["x", "y", "z"]])
    assert openai_env.requests == []


@pytest.mark.skipif(is_openai_available(), reason="needs an environment without the openai package")
def test_openai_judge_without_openai():
    with pytest.raises(ValueError, match="pip install openai") as error:
        OpenAIPairwiseJudge()
    assert isinstance(error.value, ImportError)


# ---------------------------------------------------------------------------------------------------------------------
# HfPairwiseJudge
# ---------------------------------------------------------------------------------------------------------------------


def test_hf_judge_against_local_endpoint(stub, monkeypatch):
    import huggingface_hub.constants

    # The suite runs with HF_HUB_OFFLINE=1, which blocks every huggingface_hub request, local ones included.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    random.seed(0)
    prompts, completions, expected = pairs_with_known_winner(12)
    prompts[3] = "invalid question"
    expected[3] = -1
    judge = HfPairwiseJudge(model=stub.url, system_prompt=MARKED_PROMPT)
    assert judge.judge(prompts, completions) == expected
    assert len(stub.requests) == 12
    assert all(request["body"]["max_tokens"] == 1 for request in stub.requests)
    assert all(request["path"].endswith("/chat/completions") for request in stub.requests)
    shown = stub.shown_pairs()
    assert 0 < sum(shown[p] == (c[1], c[0]) for p, c in zip(prompts, completions)) < 12


def test_hf_judge_defaults():
    judge = HfPairwiseJudge()
    assert judge.system_prompt == DEFAULT_PAIRWISE_SYSTEM_PROMPT
    assert judge.client.model == "meta-llama/Meta-Llama-3-70B-Instruct"
    with pytest.raises(ValueError, match="exactly two completions"):
        judge.judge(["a"], [["only one"]])


# ---------------------------------------------------------------------------------------------------------------------
# PairRMJudge
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(is_llm_blender_available(), reason="needs an environment without llm-blender")
def test_pair_rm_judge_without_llm_blender():
    with pytest.raises(ValueError, match="pip install llm-blender") as error:
        PairRMJudge()
    assert isinstance(error.value, ImportError)


class FakeBlender:
    """Stand-in for `llm_blender.Blender`: scores a candidate by its length (rank 1 = best)."""

    instances = []

    def __init__(self):
        self.loaded = None
        self.shown = []
        FakeBlender.instances.append(self)

    def loadranker(self, name, device=None):
        self.loaded = (name, device)

    def rank(self, inputs, candidates, return_scores=False, batch_size=8, disable_tqdm=False):
        import numpy as np

        self.shown.extend(candidates)
        scores = np.array([[float(len(c)) for c in pair] for pair in candidates])
        if return_scores:
            return scores
        return np.where(scores[:, :1] >= scores[:, 1:], [[1, 2]], [[2, 1]])


@pytest.fixture
def fake_llm_blender(monkeypatch):
    """Install a stand-in `llm_blender` module (the real package needs transformers<5 and network access)."""
    module = types.ModuleType("llm_blender")
    module.__spec__ = importlib.machinery.ModuleSpec("llm_blender", None)
    module.__version__ = "0.0.2"
    module.Blender = FakeBlender
    monkeypatch.setitem(sys.modules, "llm_blender", module)
    _package_version.cache_clear()
    FakeBlender.instances.clear()
    yield module
    monkeypatch.undo()
    _package_version.cache_clear()


def test_pair_rm_judge_needs_transformers_below_5(fake_llm_blender, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.0.0")
    with pytest.raises(RuntimeError, match="transformers>=5"):
        PairRMJudge()


def test_pair_rm_judge_verdicts_and_scores(fake_llm_blender, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.57.0")
    judge = PairRMJudge()
    blender = FakeBlender.instances[-1]
    assert blender.loaded[0] == "llm-blender/PairRM"

    random.seed(0)
    prompts, completions, expected = pairs_with_known_winner(16)
    assert judge.judge(prompts, completions) == expected
    flipped = [shown == [pair[1], pair[0]] for shown, pair in zip(blender.shown, completions)]
    assert 0 < sum(flipped) < 16

    # Probabilities that the first completion wins: softmax of the (length) scores, in the caller's order.
    import math

    pairs = [["ab", "abcd"], ["abc", "a"]]
    probs = judge.judge(["p", "q"], pairs, return_scores=True, temperature=2.0)
    assert probs == pytest.approx([1 / (1 + math.exp((4 - 2) / 2)), 1 / (1 + math.exp((1 - 3) / 2))])
    probs_unshuffled = judge.judge(["p", "q"], pairs, shuffle_order=False, return_scores=True, temperature=2.0)
    assert probs_unshuffled == pytest.approx(probs)

    with pytest.raises(ValueError, match="exactly two completions"):
        judge.judge(["p"], [["a", "b", "c"]])
    with pytest.raises(ValueError, match="temperature"):
        judge.judge(["p"], [["a", "b"]], return_scores=True, temperature=0.0)

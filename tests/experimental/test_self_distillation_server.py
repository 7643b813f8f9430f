"""SDFT/SDPO with the teacher behind the vLLM generation server (`use_teacher_server=True`) and TRL's
self-distillation callback events.

The server is faked at the HTTP boundary only: `requests.Session` inside `trl.generation.vllm_client` is replaced by
a session that answers `/health/` and `/get_sequence_logprobs/` (binary format) by running the trainer's own model,
which is what a server holding the live student's weights returns. Everything from `VLLMClient` inwards is real.
"""

import base64
import math
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from trainer_utils import args_builder, train_logs
from transformers import TrainerCallback

from trl.experimental._self_distillation.teacher_server import (
    build_teacher_request_inputs,
    server_self_distillation_per_token,
)
from trl.experimental.sdft import SDFTConfig, SDFTTrainer
from trl.experimental.sdpo import SDPOConfig, SDPOTrainer
from trl.generation import vllm_client


pytestmark = pytest.mark.usefixtures("single_thread")

COMMON = dict(
    max_steps=2,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=6,
    learning_rate=1e-2,
    gradient_checkpointing=False,
)
make_sdft_args = args_builder(SDFTConfig, **COMMON)
make_sdpo_args = args_builder(SDPOConfig, **COMMON)
SERVER = dict(use_teacher_server=True, use_vllm=True, vllm_mode="server", teacher_model_kind="live")


@pytest.fixture(scope="module")
def context_prompts():
    return Dataset.from_dict(
        {
            "prompt": ["The sky is", "Hello my", "One two", "Cats are"],
            "privileged_context": ["blue", "friend", "three", "cute"],
        }
    )


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.contiguous().numpy().tobytes()).decode()


class _Response:
    def __init__(self, payload):
        self.status_code, self._payload, self.headers, self.text = 200, payload, {}, ""

    def json(self):
        return self._payload


class FakeServerSession:
    """`requests.Session` stand-in answering as a `trl vllm-serve` holding `model` would."""

    model = None
    requests: list = []

    def get(self, url, timeout=None):
        if url.endswith("/openapi.json"):  # the client reads which scoring route the server has
            return _Response({"paths": {"/health/": {}, "/get_sequence_logprobs/": {}}})
        assert url.endswith("/health/"), url
        return _Response({"status": "ok"})

    def post(self, url, json=None):
        assert url.endswith("/get_sequence_logprobs/"), url
        type(self).requests.append(json)
        k, temperature = json["top_logprobs"], json["temperature"]
        rows = []
        with torch.no_grad():
            for sequence, prompt_length in zip(json["sequences"], json["prompt_lengths"]):
                ids = torch.tensor([sequence])
                logps = (self.model(input_ids=ids).logits[0, prompt_length - 1 : -1] / temperature).log_softmax(-1)
                top = logps.topk(k, dim=-1)
                actual = logps.gather(-1, ids[0, prompt_length:, None])[:, 0]
                rows.append((top.values, top.indices, actual, ids[0, prompt_length:]))
        width = max(len(row[2]) for row in rows)
        top = torch.full((len(rows), width, k), float("-inf"))
        top_ids = torch.zeros((len(rows), width, k), dtype=torch.int32)
        actual = torch.full((len(rows), width), float("-inf"))
        actual_ids = torch.zeros((len(rows), width), dtype=torch.int32)
        for i, (values, indices, act, tokens) in enumerate(rows):
            n = len(act)
            top[i, :n], top_ids[i, :n], actual[i, :n], actual_ids[i, :n] = values, indices, act, tokens
        return _Response(
            {
                "shape": [len(rows), width, k],
                "completion_lengths": [len(row[2]) for row in rows],
                "logprobs_b64": _b64(top),
                "token_ids_b64": _b64(top_ids),
                "actual_logprobs_b64": _b64(actual),
                "actual_token_ids_b64": _b64(actual_ids),
            }
        )


def _serve_teacher(trainer, monkeypatch):
    """Point the trainer at the fake server: the real client over the fake HTTP session, weight pushes recorded;
    the completions are sampled by transformers (the fake serves the scoring only)."""
    monkeypatch.setattr(vllm_client.requests, "Session", FakeServerSession)
    FakeServerSession.model, FakeServerSession.requests = trainer.model, []
    pushes = []
    trainer.vllm_generation = SimpleNamespace(
        client=vllm_client.VLLMClient(base_url="http://teacher.invalid:8000"),
        _synced_version=0,
        sync_weights=lambda model: pushes.append(trainer.state.global_step),
    )
    trainer.args.use_teacher_server = True
    trainer._generate_with_vllm = lambda prompt_ids, images=None: (trainer._generate_text(prompt_ids), None)
    return pushes


def _trainer(cls, make_args, tmp_path, model_path, data, **config):
    kwargs = {"reward_funcs": lambda completions, **kw: [1.0] * len(completions)} if cls is SDPOTrainer else {}
    return cls(model=model_path, args=make_args(tmp_path, **config), train_dataset=data, **kwargs)


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(use_teacher_server=True), "use_vllm=True` and `vllm_mode='server'"),
        (dict(use_teacher_server=True, use_vllm=True, vllm_mode="server"), "teacher_model_kind='live'"),
        ({**SERVER, "distillation_mode": "full_logits"}, "full_logits` is unavailable"),
        ({**SERVER, "distillation_topk": None}, "needs `distillation_topk`"),
    ],
)
def test_server_teacher_refuses_unservable_settings(tmp_path, model_path, context_prompts, config, match):
    with pytest.raises(ValueError, match=match):
        _trainer(SDFTTrainer, make_sdft_args, tmp_path, model_path, context_prompts, **config)


def test_sdpo_server_teacher_needs_pure_distillation(tmp_path, model_path, context_prompts):
    with pytest.raises(ValueError, match="distillation_weight=1.0"):
        _trainer(SDPOTrainer, make_sdpo_args, tmp_path, model_path, context_prompts, **SERVER, distillation_weight=0.5)


def test_build_teacher_request_inputs():
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [1, 2, 3, 4, 9, 9]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    prompt = torch.tensor([[0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]])
    assert build_teacher_request_inputs(ids, mask, prompt) == ([[5, 6, 7, 8], [1, 2, 3, 4, 9, 9]], [2, 3], [2, 3])
    with pytest.raises(ValueError, match="same shape"):
        build_teacher_request_inputs(ids, mask[:, :3], prompt)
    with pytest.raises(ValueError, match="Invalid prompt length 6"):
        build_teacher_request_inputs(ids, mask, torch.ones_like(ids))


def test_server_topk_loss_matches_hand_formula():
    """Top-k on the teacher's support: the student's true log-probs there, renormalised, reverse KL; a position past
    the completion contributes nothing even though the server sent -inf there."""
    student = torch.tensor([[[2.0, 0.5, -1.0, 0.1], [0.0, 0.0, 0.0, 0.0]]])
    teacher_top = torch.tensor([[[-0.5, -1.5], [float("-inf"), float("-inf")]]])
    teacher = {
        "actual": torch.tensor([[-0.5, float("-inf")]]),
        "top": teacher_top,
        "top_ids": torch.tensor([[[1, 3], [0, 0]]]),
    }
    args = SimpleNamespace(distillation_mode="topk_logits", distillation_add_tail=False, distillation_alpha=1.0)
    mask = torch.tensor([[1, 0]])
    per_token, abs_diff = server_self_distillation_per_token(student, torch.tensor([[1, 0]]), mask, teacher, args)
    p_s = student[0, 0].softmax(-1)
    s = [p_s[1].item() / (p_s[1] + p_s[3]).item(), p_s[3].item() / (p_s[1] + p_s[3]).item()]
    t = [math.exp(-0.5) / (math.exp(-0.5) + math.exp(-1.5)), math.exp(-1.5) / (math.exp(-0.5) + math.exp(-1.5))]
    expected = sum(a * (math.log(a) - math.log(b)) for a, b in zip(s, t))
    assert per_token[0, 0].item() == pytest.approx(expected, rel=1e-5)
    assert per_token[0, 1].item() == 0.0
    assert abs_diff.item() == pytest.approx(abs(-0.5 - math.log(p_s[1].item())), rel=1e-5)


def test_sdft_server_sampled_token_equals_the_local_live_teacher(tmp_path, model_path, context_prompts, monkeypatch):
    """A server holding the student's weights gives the local live teacher's loss; weights are pushed once the
    student changed; the requests carry the teacher prompts and the sampled-token top-1."""
    config = dict(teacher_model_kind="live", distillation_mode="sampled_token", distillation_alpha=1.0, seed=3)
    local = _trainer(SDFTTrainer, make_sdft_args, tmp_path / "local", model_path, context_prompts, **config)
    local.train()
    served = _trainer(SDFTTrainer, make_sdft_args, tmp_path / "served", model_path, context_prompts, **config)
    pushes = _serve_teacher(served, monkeypatch)
    before = {n: p.detach().clone() for n, p in served.model.named_parameters()}
    served.train()
    assert any(not torch.equal(before[n], p) for n, p in served.model.named_parameters())
    local_logs, served_logs = train_logs(local), train_logs(served)
    for ours, theirs in zip(served_logs, local_logs):
        # Equal up to float rounding: the server scores each row unpadded (other RoPE positions), and the loss is a
        # difference of nearly equal log-probabilities. A wrong teacher prompt would give 0, another model far more.
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-2) and ours["loss"] != 0.0
        assert math.isfinite(ours["self_distillation/server_logprob_abs_diff"])
        assert "self_distillation/server_logprob_abs_diff" not in theirs
    assert pushes == [1]
    request = FakeServerSession.requests[0]
    assert request["top_logprobs"] == 1 and request["temperature"] == 1.0
    assert len(request["sequences"]) == 4


@pytest.mark.parametrize("cls, make_args", [(SDFTTrainer, make_sdft_args), (SDPOTrainer, make_sdpo_args)])
def test_server_topk_trains(tmp_path, model_path, context_prompts, monkeypatch, cls, make_args):
    config = dict(
        teacher_model_kind="live", distillation_mode="topk_logits", distillation_topk=5, distillation_alpha=0.5
    )
    trainer = _trainer(cls, make_args, tmp_path, model_path, context_prompts, **config)
    _serve_teacher(trainer, monkeypatch)
    trainer.train()
    last = train_logs(trainer)[-1]
    assert math.isfinite(last["loss"]) and math.isfinite(last["self_distillation/server_logprob_abs_diff"])
    assert FakeServerSession.requests[0]["top_logprobs"] == 5


class _Recorder(TrainerCallback):
    """Records TRL's self-distillation events (the hooks `TrainerCallback` does not define)."""

    def __init__(self):
        self.events = []

    def __getattr__(self, name):
        if not name.startswith("on_"):
            raise AttributeError(name)

        def hook(**kwargs):
            self.events.append((name, kwargs))

        return hook


@pytest.mark.parametrize("generate_from_teacher", [False, True])
def test_sdft_callback_events(tmp_path, model_path, context_prompts, generate_from_teacher):
    recorder = _Recorder()
    trainer = SDFTTrainer(
        model=model_path,
        args=make_sdft_args(tmp_path, max_steps=1, generate_from_teacher=generate_from_teacher),
        train_dataset=context_prompts,
    )
    trainer.add_callback(recorder)
    trainer.train()
    custom = recorder.events
    assert [n for n, _ in custom] == [
        "on_generation_prompts_selected",
        "on_self_distillation_batch_prepared",
        "on_generation_batch_built",
    ]
    prompts = custom[0][1]["generation_prompts"]
    assert len(prompts) == 4 and custom[0][1]["generation_prompt_text"] is None
    assert all(("\n\n" in p) == generate_from_teacher for p in prompts)
    prepared = custom[1][1]
    assert {"args", "state", "control", "model", "processing_class"} <= set(prepared)
    completion_width = prepared["completion_ids"].shape[1]
    assert prepared["teacher_input_ids"].shape == prepared["teacher_attention_mask"].shape
    assert torch.equal(prepared["teacher_input_ids"][:, -completion_width:], prepared["completion_ids"])
    assert custom[2][1]["generate_every"] == 1 and custom[2][1]["steps_per_generation"] == 1

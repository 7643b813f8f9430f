"""Sparse-support divergence helpers and ServerDistillationTrainer (the teacher server replaced by a local scorer at
the HTTP boundary: `VLLMClient` is swapped for an object with the same `get_sequence_logprobs` output)."""

import math

import pytest
import torch
from trainer_utils import (
    ROLLOUT_METRICS,
    args_builder,
    assert_saved_model_reloads,
    resume_from_first_checkpoint,
    train_and_check_metrics,
)
from transformers import AutoModelForCausalLM

import trl.generation.vllm_client as vllm_client_module
from trl.assets import get_model_path
from trl.experimental.server_distillation import (
    ServerDistillationConfig,
    ServerDistillationTrainer,
    build_teacher_request_inputs,
)
from trl.trainer.utils.sparse_divergence import (
    add_tail_bucket,
    masked_sparse_divergence,
    pad_teacher_rows,
    renormalize_on_support,
    sparse_support_divergence,
    top1_sparse_support,
)


pytestmark = pytest.mark.usefixtures("single_thread")
URL = "http://127.0.0.1:9"
make_args = args_builder(
    ServerDistillationConfig,
    teacher_model_server_url=URL,
    max_steps=2,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    max_completion_length=6,
    learning_rate=1e-2,
    seed=0,
)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers against hand-written formulas
# ---------------------------------------------------------------------------------------------------------------------
def test_tail_bucket_holds_the_remaining_mass_of_valid_slots():
    log_probs = torch.log(torch.tensor([0.2, 0.5, 0.1]))
    out = add_tail_bucket(log_probs, torch.tensor([True, True, False]))
    assert torch.allclose(out.exp(), torch.tensor([0.2, 0.5, 0.1, 0.3]), atol=1e-6)
    full = add_tail_bucket(torch.log(torch.tensor([0.4, 0.6])))  # all the mass on the support: tail stays finite
    assert torch.isfinite(full).all() and full[-1] == pytest.approx(math.log(1e-7), rel=1e-2)


def test_renormalize_on_support_ignores_invalid_slots():
    out = renormalize_on_support(torch.log(torch.tensor([0.2, 0.6, 0.2])), torch.tensor([True, True, False]))
    assert torch.allclose(out[:2].exp(), torch.tensor([0.25, 0.75]))
    assert out[2] == float("-inf")


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3])
def test_masked_sparse_divergence_matches_hand_formula(beta):
    p_s, p_t = [0.2, 0.5, 0.3], [0.4, 0.4, 0.2]
    valid = torch.tensor([True, True, False])
    got = masked_sparse_divergence(torch.log(torch.tensor(p_s)), torch.log(torch.tensor(p_t)), valid, beta)
    expected = 0.0
    for s, t in zip(p_s[:2], p_t[:2]):
        if beta == 0.0:
            expected += t * math.log(t / s)
        elif beta == 1.0:
            expected += s * math.log(s / t)
        else:
            m = (1 - beta) * s + beta * t
            expected += beta * t * math.log(t / m) + (1 - beta) * s * math.log(s / m)
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_masked_sparse_divergence_zeroes_nan_and_invalid_terms():
    student = torch.tensor([float("-inf"), math.log(0.5)])
    teacher = torch.tensor([float("-inf"), math.log(0.25)])
    got = masked_sparse_divergence(student, teacher, torch.tensor([True, True]), 1.0)
    assert got.item() == pytest.approx(0.5 * math.log(2.0))


def test_top1_sparse_support():
    top1, top1_lp = torch.tensor([3, 4]), torch.tensor([-0.1, -0.2])
    sampled, sampled_lp = torch.tensor([3, 7]), torch.tensor([-0.1, -2.0])
    ids, lps, valid = top1_sparse_support(top1, top1_lp, sampled, sampled_lp, beta=0.5)
    assert ids.tolist() == [[3, 3], [4, 7]] and valid.tolist() == [[True, False], [True, True]]
    assert torch.equal(lps, torch.tensor([[-0.1, -0.1], [-0.2, -2.0]]))
    ids, lps, valid = top1_sparse_support(top1, top1_lp, sampled, sampled_lp, beta=1.0)
    assert ids.tolist() == [[3], [7]] and valid.all() and torch.equal(lps, torch.tensor([[-0.1], [-2.0]]))


def test_sparse_support_divergence_reverse_kl_on_sampled_token_with_tail():
    student = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    ids, lps, valid = top1_sparse_support(
        torch.tensor(0), torch.log(torch.tensor(0.5)), torch.tensor(1), torch.log(torch.tensor(0.2)), beta=1.0
    )
    got = sparse_support_divergence(student, ids, lps, valid, beta=1.0, add_tail=True)
    expected = 0.6 * math.log(0.6 / 0.2) + 0.4 * math.log(0.4 / 0.8)
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_sparse_support_over_the_whole_vocabulary_is_the_full_divergence():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5).log_softmax(-1), torch.randn(2, 5).log_softmax(-1)
    ids = torch.arange(5).expand(2, 5)
    valid = torch.ones(2, 5, dtype=torch.bool)
    for beta in (0.0, 0.5, 1.0):
        got = sparse_support_divergence(student, ids, teacher, valid, beta, add_tail=False)
        full = masked_sparse_divergence(student, teacher, valid, beta)
        assert torch.allclose(got, full, atol=1e-6)


def test_build_teacher_request_inputs():
    ids = torch.tensor([[0, 5, 6, 7, 8], [1, 2, 3, 4, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    labels = torch.tensor([[-100, -100, -100, 7, 8], [-100, 2, 3, 4, -100]])
    expected = ([[5, 6, 7, 8], [1, 2, 3, 4]], [2, 1], [2, 3])
    assert build_teacher_request_inputs(ids, mask, labels=labels) == expected
    assert build_teacher_request_inputs(ids, mask, prompt_attention_mask=torch.tensor([[0, 1, 1], [0, 0, 1]])) == (
        expected[0],
        [2, 1],
        [2, 3],
    )
    with pytest.raises(ValueError, match="labels"):
        build_teacher_request_inputs(ids, mask)
    with pytest.raises(ValueError, match="same shape"):
        build_teacher_request_inputs(ids, mask[:, :3], labels=labels)
    with pytest.raises(ValueError, match="Invalid prompt length"):
        build_teacher_request_inputs(ids, mask, labels=torch.full_like(labels, 5))


def test_pad_teacher_rows_accepts_lists_and_per_position_lists():
    out = pad_teacher_rows([[[-0.1], [-0.2]], []], 3, float("-inf"), torch.float32)
    assert out.shape == (2, 3, 1) and out[0, 1, 0] == pytest.approx(-0.2) and out[1].isinf().all()


# ---------------------------------------------------------------------------------------------------------------------
# The trainer, with a local scorer behind the client boundary
# ---------------------------------------------------------------------------------------------------------------------
class LocalScorer:
    """`VLLMClient.get_sequence_logprobs` computed by a local causal LM (TRL 1.16's output layout)."""

    def __init__(self, model):
        self.model = model
        self.requests = []

    def get_sequence_logprobs(self, sequences, prompt_lengths, top_logprobs=100, temperature=1.0, **_):
        self.requests.append((sequences, prompt_lengths, top_logprobs, temperature))
        out = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
        for sequence, prompt_length in zip(sequences, prompt_lengths):
            ids = torch.tensor([sequence])
            with torch.no_grad():
                log_probs = (self.model(ids).logits[0].float() / temperature).log_softmax(-1)
            scored = log_probs[prompt_length - 1 : len(sequence) - 1]
            top = scored.topk(top_logprobs, dim=-1)
            targets = ids[0, prompt_length:, None]
            out["logprobs"].append(top.values.tolist())
            out["logprob_token_ids"].append(top.indices.tolist())
            out["actual_logprobs"].append(scored.gather(-1, targets).tolist())
            out["actual_token_ids"].append(targets.tolist())
        return out


@pytest.fixture(scope="module")
def teacher():
    return AutoModelForCausalLM.from_pretrained(get_model_path("small-Qwen2ForCausalLM")).eval()


@pytest.fixture
def fake_server(monkeypatch, teacher):
    made = []

    def factory(*args, **kwargs):
        made.append(kwargs)
        return LocalScorer(teacher)

    monkeypatch.setattr(vllm_client_module, "VLLMClient", factory)
    return made


def test_config_requires_a_url_and_top1_support(tmp_path):
    with pytest.raises(ValueError, match="teacher_model_server_url"):
        ServerDistillationConfig(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(ValueError, match="loss_top_k"):
        ServerDistillationConfig(output_dir=str(tmp_path), use_cpu=True, teacher_model_server_url=URL, loss_top_k=4)
    with pytest.raises(ValueError, match="argmax"):
        ServerDistillationConfig(
            output_dir=str(tmp_path), use_cpu=True, teacher_model_server_url=URL, reverse_kl_top_1_mode="argmax"
        )
    args = ServerDistillationConfig(output_dir=str(tmp_path), use_cpu=True, teacher_model_server_url=URL)
    assert (args.beta, args.loss_top_k, args.loss_add_tail, args.vllm_server_port) == (1.0, 1, True, 8001)


def test_loss_is_reverse_kl_on_the_sampled_token_support(tmp_path, model_path, prompts, fake_server, teacher):
    trainer = ServerDistillationTrainer(model_path, args=make_args(tmp_path), train_dataset=prompts)
    assert fake_server == [{"base_url": URL, "connection_timeout": 60.0}]
    prompt_ids = torch.tensor([[0, 11, 12], [13, 14, 15]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[21, 22, 23], [24, 25, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    inputs = dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, completion_mask=completion_mask
    )
    loss = trainer._compute_loss(trainer.model, inputs)
    # By hand: per completion token, the 2-slot support {sampled token, tail}.
    terms = []
    for row in range(2):
        ids = torch.cat([prompt_ids[row][prompt_mask[row].bool()], completion_ids[row][completion_mask[row].bool()]])
        p = int(prompt_mask[row].sum())
        with torch.no_grad():
            student = trainer.model(ids[None]).logits[0].double().log_softmax(-1)
            teach = teacher(ids[None]).logits[0].double().log_softmax(-1)
        for t in range(p, len(ids)):
            s, q = student[t - 1, ids[t]].exp().item(), teach[t - 1, ids[t]].exp().item()
            terms.append(s * math.log(s / q) + (1 - s) * math.log((1 - s) / (1 - q)))
    # float32 in the trainer: the two terms nearly cancel for these tiny probabilities
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=2e-3)


def test_trains_evaluates_saves(tmp_path, model_path, prompts, fake_server):
    trainer = ServerDistillationTrainer(
        model_path, args=make_args(tmp_path, beta=0.0, loss_top_k=3), train_dataset=prompts, eval_dataset=prompts
    )
    evaluation = train_and_check_metrics(trainer, ROLLOUT_METRICS)
    assert math.isfinite(evaluation["eval_loss"])
    assert "entropy" not in trainer.state.log_history[0]
    assert_saved_model_reloads(trainer, tmp_path / "saved")
    assert trainer.teacher_client.requests[0][2:] == (3, 1.0)


def test_resumes(tmp_path, model_path, prompts, fake_server):
    args = make_args(tmp_path, beta=0.5, save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(ServerDistillationTrainer, args, tmp_path, model=model_path, train_dataset=prompts)

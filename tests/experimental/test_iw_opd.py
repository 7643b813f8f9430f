"""IW-OPD configuration rules and its loss against a hand-written formula."""

import math
import warnings

import pytest
import torch
from trainer_utils import (
    assert_saved_model_reloads,
    changed_params,
    record_calls,
    resume_from_first_checkpoint,
    snapshot,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

import trl.generation.vllm_client as vllm_client_module
from trl.assets import get_model_path, load_test_dataset
from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer
from trl.experimental.iw_opd.iw_opd_trainer import (
    _completion_positions,
    _DistillationCollator,
    _logits_at,
    build_teacher_request_inputs,
    iw_opd_loss,
)
from trl.trainer.utils import sparse_divergence


def _config(tmp_path, **kwargs):
    return IWOPDConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **kwargs)


def test_defaults_and_derived_fields(tmp_path):
    args = _config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=2)
    assert (args.learning_rate, args.beta, args.lmbda, args.distillation_objective) == (1e-6, 1.0, 1.0, "iw_opd")
    assert (args.max_prompt_length, args.generation_batch_size) == (1024 - 512, 4)
    assert build_teacher_request_inputs is sparse_divergence.build_teacher_request_inputs


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lmbda=1.5), "lmbda"),
        (dict(distillation_objective="kl"), "distillation_objective"),
        (dict(iw_opd_gamma=-1.0), "iw_opd_gamma"),
        (dict(iw_opd_epsilon=0.0), "iw_opd_epsilon"),
        (dict(max_completion_length=2000), "max_completion_length"),
        (dict(per_device_train_batch_size=3, num_generations=2), "generation_batch_size"),
        (dict(lmbda=0.5), "lmbda=1.0"),
        (dict(use_vllm=True, vllm_sync_frequency=2), "vllm_sync_frequency"),
        (dict(use_teacher_server=True), "teacher_model_server_url"),
        (dict(use_teacher_server=True, teacher_model_server_url="u", distillation_objective="jsd", loss_top_k=2), "1"),
    ],
)
def test_invalid_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **kwargs)


def test_argmax_without_effect_warns(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _config(tmp_path, distillation_objective="jsd", reverse_kl_top_1_mode="argmax", beta=0.0)
    assert any("has no effect" in str(w.message) for w in caught)


def test_iw_opd_loss_matches_hand_formula():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -9.0]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -2.5, -0.2], [-0.1, -1.0, float("nan")]])
    sampler = torch.tensor([[-1.1, -2.1, -0.4], [-0.2, -1.4, -3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    gamma = 0.5
    loss, metrics = iw_opd_loss(student, teacher, sampler, mask, gamma=gamma)
    expected, weights, advantages = 0.0, [], []
    for row in range(2):
        a = [teacher[row, t].item() - sampler[row, t].item() for t in range(3) if mask[row, t]]
        total = max(sum(abs(x) for x in a), 1e-8)
        prefix = 0.0
        for t, adv in enumerate(a):
            w = 1 + gamma * (1 - prefix / total)
            expected += -w * adv * student[row, t].item()
            prefix += abs(adv)
            weights.append(w)
            advantages.append(adv)
    assert loss.item() == pytest.approx(expected / 5, rel=1e-6)
    assert metrics["mean_weight"].item() == pytest.approx(sum(weights) / 5, rel=1e-6)
    assert metrics["max_weight"].item() == pytest.approx(1 + gamma)
    assert metrics["mean_abs_advantage"].item() == pytest.approx(sum(map(abs, advantages)) / 5, rel=1e-6)
    weighted = sum(w * a for w, a in zip(weights, advantages))
    assert metrics["mean_advantage"].item() == pytest.approx(weighted / 5, rel=1e-6)
    loss.backward()
    assert student.grad[1, 2] == 0 and math.isfinite(student.grad.sum().item())
    # With num_items_in_batch and no sampler: the detached student is the behaviour policy.
    loss2, _ = iw_opd_loss(student, teacher.nan_to_num(0.0), None, mask, num_items_in_batch=10)
    a = (teacher.nan_to_num(0.0) - student.detach()) * mask
    assert loss2.item() == pytest.approx(
        iw_opd_loss(student, teacher.nan_to_num(0.0), student.detach(), mask)[0].item() * 5 / 10, rel=1e-6
    )
    assert a.abs().sum() > 0


def test_iw_opd_loss_requires_teacher_log_probs_on_valid_positions():
    with pytest.raises(ValueError, match="teacher log-probability"):
        iw_opd_loss(torch.zeros(1, 2), torch.tensor([[0.0, float("-inf")]]), None, torch.ones(1, 2))


# ---------------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------------
STUDENT, TEACHER = get_model_path("tiny-Qwen2ForCausalLM"), get_model_path("small-Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def conversations():
    return load_test_dataset("conversational_language_modeling", split="train").select(range(8))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STUDENT)


def _trainer_args(tmp_path, **kwargs):
    defaults = dict(
        max_steps=2,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        max_length=96,
        max_completion_length=6,
        learning_rate=1e-3,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return _config(tmp_path, **{**defaults, **kwargs})


def test_collator_splits_the_last_assistant_turn(tokenizer):
    messages = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}],
        [
            {"role": "user", "content": "Count"},
            {"role": "assistant", "content": "1"},
            {"role": "user", "content": "x"},
        ],
    ]
    batch = _DistillationCollator(tokenizer, max_length=200, max_prompt_length=150)(
        [{"messages": m} for m in messages]
    )
    completion = [t for t in batch["labels"][0].tolist() if t != -100]
    assert tokenizer.decode(completion) == "Hello there<|im_end|>\n"
    assert (batch["labels"][1] == -100).all()  # ends with a user turn: prompt only
    prompt = batch["prompts"][1][batch["prompt_attention_mask"][1].bool()]
    assert tokenizer.decode(prompt).endswith("x<|im_end|>\n<|im_start|>assistant\n")
    assert batch["attention_mask"][:, -1].all()  # left padding
    short = _DistillationCollator(tokenizer, max_length=40, max_prompt_length=36)([{"messages": messages[0]}])
    assert short["prompt_attention_mask"].sum() == 36 and short["input_ids"].shape[1] == 40


def test_completion_positions_follow_the_labels():
    labels = torch.tensor([[-100, -100, 5, 6, 7], [-100, -100, -100, 8, -100], [-100] * 5])
    positions, tokens, mask = _completion_positions(labels)
    assert positions[mask].tolist() == [1, 2, 3, 2]  # the index before each completion token
    assert tokens.tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert mask.tolist() == [[True] * 3, [True, False, False], [False] * 3]


def test_logits_at_completion_positions_equal_the_full_logits():
    """The head on the read positions only (`logits_to_keep`) gives the full forward's logits there, and the same
    gradients."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"), dtype=torch.float32)
    input_ids = torch.randint(3, 100, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    labels = torch.full_like(input_ids, -100)
    labels[0, 4:] = input_ids[0, 4:]
    labels[1, 7:] = input_ids[1, 7:]
    positions, _, _ = _completion_positions(labels)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}

    full = model(**inputs).logits
    expected = full.gather(1, positions[..., None].expand(-1, -1, full.shape[-1]))
    weight = torch.randn_like(expected)
    (expected * weight).sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    kept = _logits_at(model, inputs, positions)
    (kept * weight).sum().backward()
    torch.testing.assert_close(kept, expected)
    for param, grad in zip(model.parameters(), expected_grads, strict=True):
        # Equal up to float rounding: the head's products run over fewer rows, so sums are ordered differently.
        torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()))


def test_top_k_jsd_matches_hand_formula():
    student, teacher = torch.randn(1, 2, 6), torch.randn(1, 2, 6)
    labels = torch.tensor([[3, -100]])
    loss = IWOPDTrainer.generalized_jsd_loss(student, teacher, labels, beta=0.0, top_k=2, add_tail=False)
    log_t, log_s = teacher[0, 0].log_softmax(-1), student[0, 0].log_softmax(-1)
    ids = log_t.topk(2).indices
    p_t, p_s = log_t[ids].softmax(-1), log_s[ids].softmax(-1)
    assert loss.item() == pytest.approx((p_t * (p_t.log() - p_s.log())).sum().item(), rel=1e-4)
    full = IWOPDTrainer.generalized_jsd_loss(student, teacher, labels, beta=0.5, top_k=0)
    assert full.item() == pytest.approx(
        sparse_divergence.masked_sparse_divergence(log_s, log_t, torch.ones(6, dtype=torch.bool), 0.5).item(), rel=1e-5
    )


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(), ["iw_opd/mean_weight", "completions/on_policy_mean_length", "on_policy_loss"]),
        (dict(distillation_objective="jsd", lmbda=0.0, beta=0.5, loss_top_k=0), ["off_policy_loss"]),
    ],
)
def test_trains_evaluates_saves(tmp_path, conversations, tokenizer, kwargs, expected):
    args = _trainer_args(tmp_path, **kwargs)
    trainer = IWOPDTrainer(
        STUDENT,
        TEACHER,
        args=args,
        train_dataset=conversations,
        eval_dataset=conversations,
        processing_class=tokenizer,
    )
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    for key in expected:
        assert key in logs[-1] and math.isfinite(logs[-1][key]), key
    assert math.isfinite(trainer.evaluate()["eval_loss"])
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_logs_a_completions_table(tmp_path, conversations, tokenizer):
    args = _trainer_args(tmp_path, log_completions=True, log_completions_steps=1, max_steps=1)
    trainer = IWOPDTrainer(STUDENT, TEACHER, args=args, train_dataset=conversations, processing_class=tokenizer)
    trainer.train()
    assert list((tmp_path / "completions").glob("*.parquet"))  # the on-policy samples of step 1


def test_resumes(tmp_path, conversations, tokenizer):
    args = _trainer_args(tmp_path, save_strategy="steps", save_steps=1, distillation_objective="jsd", lmbda=0.0)
    resume_from_first_checkpoint(
        IWOPDTrainer,
        args,
        tmp_path,
        model=STUDENT,
        teacher_model=TEACHER,
        train_dataset=conversations,
        processing_class=tokenizer,
    )


class _Scorer:
    """Stands in for the teacher server: scores sequences with a local model, in `get_sequence_logprobs`' format."""

    def __init__(self):
        self.model = AutoModelForCausalLM.from_pretrained(TEACHER).eval()
        self.requests = []

    def get_sequence_logprobs(self, sequences, prompt_lengths, top_logprobs=100, temperature=1.0, **_):
        self.requests.append((len(sequences), top_logprobs, temperature))
        out = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": []}
        for sequence, prompt_length in zip(sequences, prompt_lengths):
            with torch.no_grad():
                log_probs = (self.model(torch.tensor([sequence])).logits[0] / temperature).log_softmax(-1)
            scored = log_probs[prompt_length - 1 : len(sequence) - 1]
            top = scored.topk(top_logprobs, dim=-1)
            out["logprobs"].append(top.values.tolist())
            out["logprob_token_ids"].append(top.indices.tolist())
            out["actual_logprobs"].append(scored.gather(-1, torch.tensor(sequence[prompt_length:])[:, None]).tolist())
        return out


def test_server_teacher_matches_local_teacher(tmp_path, conversations, tokenizer, monkeypatch):
    monkeypatch.setattr(vllm_client_module, "VLLMClient", lambda **kwargs: _Scorer())
    server_args = _trainer_args(tmp_path, use_teacher_server=True, teacher_model_server_url="http://127.0.0.1:9")
    server = IWOPDTrainer(STUDENT, args=server_args, train_dataset=conversations, processing_class=tokenizer)
    local = IWOPDTrainer(
        STUDENT, TEACHER, args=_trainer_args(tmp_path), train_dataset=conversations, processing_class=tokenizer
    )
    batch = next(iter(local.get_train_dataloader()))
    local_loss = local.compute_loss(local.model, batch)
    server_loss = server.compute_loss(server.model, batch)
    assert server_loss.item() == pytest.approx(local_loss.item(), rel=1e-4)
    assert server.teacher_client.requests[0][1:] == (1, 1.0)


def test_needs_a_teacher_and_messages(tmp_path, conversations):
    with pytest.raises(ValueError, match="needs a teacher"):
        IWOPDTrainer(STUDENT, args=_trainer_args(tmp_path), train_dataset=conversations)
    prompts = load_test_dataset("standard_prompt_only", split="train")
    with pytest.raises(ValueError, match="messages"):
        IWOPDTrainer(STUDENT, TEACHER, args=_trainer_args(tmp_path), train_dataset=prompts)


@pytest.mark.parametrize("objective", ["iw_opd", "jsd"])
def test_teacher_runs_first_so_the_student_keeps_layers(tmp_path, conversations, tokenizer, monkeypatch, objective):
    """The local teacher scores the batch before the student's forward pass and the student's logits are declared
    small, so that under gradient checkpointing the student's last layers may keep their activations
    (`LayerBudget`; at the tiny width the first forward keeps one): the losses and weights of transformers'
    checkpoint."""
    from trl.trainer.fast_paths import layer_checkpoints

    results = []
    for lean in (True, False):
        if not lean:
            monkeypatch.setattr(layer_checkpoints, "layer_checkpoint_fallback_reason", lambda layer: "off")
        extra = {} if objective == "iw_opd" else dict(distillation_objective="jsd", beta=0.5, loss_top_k=0)
        args = _trainer_args(
            tmp_path / str(lean), gradient_accumulation_steps=1, gradient_checkpointing=True, seed=0, **extra
        )
        trainer = IWOPDTrainer(STUDENT, TEACHER, args=args, train_dataset=conversations, processing_class=tokenizer)
        kept = []
        with pytest.MonkeyPatch.context() as patch:
            record_calls(patch, layer_checkpoints.LayerBudget, "run_kept", kept)
            trainer.train()
        assert bool(kept) == lean
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        results.append((losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}))
    (losses, weights), (plain_losses, plain_weights) = results
    assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-9)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-7, msg=name)

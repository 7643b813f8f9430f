"""Experimental GOLDTrainer: config, the ULD loss against hand formulas, alignment of two tokenizations, the hybrid
loss, same-tokenizer mode equal to GKD's loss, training across tokenizers, checkpoints and bad input."""

import math

import pytest
import torch
from trainer_utils import (
    args_builder,
    assert_saved_model_reloads,
    changed_params,
    perturb,
    resume_from_first_checkpoint,
    snapshot,
    train_logs,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl.assets import get_model_path, get_tokenizer_path, load_test_dataset
from trl.experimental.gkd import GKDConfig, GKDTrainer
from trl.experimental.gold import GOLDConfig, GOLDTrainer
from trl.experimental.gold.gold_trainer import ULDLoss, build_teacher_inputs_from_texts
from trl.experimental.gold.uld import align_by_byte_offsets, merge_group_probabilities, shared_vocabulary
from trl.import_utils import is_vllm_available


pytestmark = pytest.mark.usefixtures("single_thread")

LLAMA = get_model_path("tiny-LlamaForCausalLM")

make_args = args_builder(
    GOLDConfig,
    max_steps=2,
    per_device_train_batch_size=2,
    per_device_eval_batch_size=2,
    max_completion_length=6,
    seed=0,
    lmbda=0.0,
    learning_rate=1e-2,
)


@pytest.fixture(scope="module")
def conversations():
    data = load_test_dataset("conversational_language_modeling")
    return data["train"].select(range(8)), data["test"].select(range(4))


@pytest.fixture(scope="module")
def qwen_tok():
    return AutoTokenizer.from_pretrained(get_tokenizer_path("qwen2_5"))


@pytest.fixture(scope="module")
def llama_tok():
    return AutoTokenizer.from_pretrained(get_tokenizer_path("llama3"))


def cross(tmp_path, model_path, conversations, **overrides):
    train, test = conversations
    return GOLDTrainer(
        model=model_path,
        teacher_model=LLAMA,
        args=make_args(tmp_path, use_uld_loss=True, **overrides),
        train_dataset=train,
        eval_dataset=test,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------
def test_config_defaults_match_contract():
    args = GOLDConfig("out", per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert args.learning_rate == 1e-7 and args.max_length == 1024
    assert (args.temperature, args.top_p, args.top_k, args.lmbda, args.beta) == (0.9, 0.95, 0, 0.5, 0.5)
    assert args.max_completion_length == 128 and args.num_generations == 1 and args.generation_batch_size == 8
    assert args.use_uld_loss is False and args.use_extended_uld is True and args.uld_token_merge_strategy == "observed"
    assert (args.uld_crossentropy_weight, args.uld_distillation_weight) == (0.0, 1.0)
    assert args.uld_skip_student_eos and args.uld_skip_teacher_eos and args.callbacks == []
    assert (args.vllm_mode, args.vllm_server_port, args.vllm_group_port) == ("colocate", 8001, 51216)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lmbda": 1.5}, "lmbda"),
        ({"beta": -0.1}, "beta"),
        ({"top_p": 0.0}, "top_p"),
        ({"uld_token_merge_strategy": "mean"}, "uld_token_merge_strategy"),
        ({"use_uld_loss": True, "uld_use_hybrid_loss": True, "uld_hybrid_matched_weight": 0.5}, "both be None"),
        ({"uld_hybrid_matched_weight": 0.5, "uld_hybrid_unmatched_weight": 0.5}, "only apply to the hybrid"),
        ({"uld_teacher_temperature": 0.0}, "uld_teacher_temperature"),
        ({"generation_batch_size": 3}, "exactly partition"),
        ({"vllm_mode": "remote"}, "vllm_mode"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GOLDConfig("out", **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# ULD loss against hand formulas
# ---------------------------------------------------------------------------------------------------------------------
def uld_config(**overrides):
    return GOLDConfig("out", use_uld_loss=True, **overrides)


def hand_sorted_l1(p: list, q: list) -> float:
    """sum_k |sort(p)_k - sort(q)_k| with the shorter vector padded with zeros, in plain Python."""
    width = max(len(p), len(q))
    p = sorted(p + [0.0] * (width - len(p)), reverse=True)
    q = sorted(q + [0.0] * (width - len(q)), reverse=True)
    return sum(abs(a - b) for a, b in zip(p, q, strict=True))


def softmax(row: list, temperature: float = 1.0) -> list:
    exps = [math.exp(x / temperature) for x in row]
    return [e / sum(exps) for e in exps]


@pytest.fixture
def positional_case():
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(2, 5, 6, generator=generator)
    teacher = torch.randn(2, 5, 8, generator=generator)  # a larger vocabulary
    student_labels = torch.tensor([[-100, 1, 2, 3, 4], [-100, -100, -100, 1, 2]])
    teacher_labels = torch.tensor([[-100, -100, 1, 2, 3], [-100, 1, 2, 3, 4]])
    ids = torch.zeros(2, 5, dtype=torch.long)
    return student, teacher, student_labels, teacher_labels, ids


@pytest.mark.parametrize(("skip_student", "skip_teacher"), [(True, True), (False, False), (False, True)])
@pytest.mark.parametrize(("t_student", "t_teacher"), [(1.0, 1.0), (2.0, 0.5)])
def test_positional_uld_matches_hand_formula(positional_case, skip_student, skip_teacher, t_student, t_teacher):
    student, teacher, s_labels, t_labels, ids = positional_case
    loss = ULDLoss(
        uld_config(
            use_extended_uld=False,
            uld_skip_student_eos=skip_student,
            uld_skip_teacher_eos=skip_teacher,
            uld_student_temperature=t_student,
            uld_teacher_temperature=t_teacher,
        )
    )(student, teacher, s_labels, t_labels, ids, ids)
    rows = []
    for b in range(2):
        s_pos = [i for i in range(5) if s_labels[b, i] != -100][: None if not skip_student else -1]
        t_pos = [i for i in range(5) if t_labels[b, i] != -100][: None if not skip_teacher else -1]
        n = min(len(s_pos), len(t_pos))
        distances = [
            hand_sorted_l1(
                softmax(student[b, s_pos[k]].tolist(), t_student), softmax(teacher[b, t_pos[k]].tolist(), t_teacher)
            )
            for k in range(n)
        ]
        rows.append(sum(distances) / n)
    assert loss.item() == pytest.approx(sum(rows) / len(rows), rel=1e-5)


def test_crossentropy_term_is_the_students_next_token_loss(positional_case):
    student, teacher, s_labels, t_labels, ids = positional_case
    config = {"use_extended_uld": False}
    distillation = ULDLoss(uld_config(**config))(student, teacher, s_labels, t_labels, ids, ids)
    both = ULDLoss(uld_config(uld_crossentropy_weight=0.3, uld_distillation_weight=2.0, **config))(
        student, teacher, s_labels, t_labels, ids, ids
    )
    terms = [
        -math.log(softmax(student[b, i - 1].tolist())[int(s_labels[b, i])])
        for b in range(2)
        for i in range(1, 5)
        if s_labels[b, i] != -100
    ]
    assert both.item() == pytest.approx(0.3 * sum(terms) / len(terms) + 2.0 * distillation.item(), rel=1e-5)


def test_uld_gradient_reaches_only_the_student(positional_case):
    student, teacher, s_labels, t_labels, ids = positional_case
    student = student.clone().requires_grad_(True)
    teacher = teacher.clone().requires_grad_(True)
    ULDLoss(uld_config(use_extended_uld=False))(student, teacher, s_labels, t_labels, ids, ids).backward()
    assert student.grad.abs().sum() > 0 and teacher.grad is None


# ---------------------------------------------------------------------------------------------------------------------
# Alignment of two tokenizations
# ---------------------------------------------------------------------------------------------------------------------
def test_alignment_groups_tokens_ending_at_the_same_byte():
    student = [(0, 3), (3, 10), (10, 11), (11, 12), (12, 13), (13, 14), (14, 15), (15, 16), (16, 19)]
    teacher = [(0, 3), (3, 10), (10, 11), (11, 13), (13, 14), (14, 16), (16, 19), (19, 19)]
    groups_s, groups_t = align_by_byte_offsets(student, teacher)
    assert groups_s == [[0], [1], [2], [3, 4], [5], [6, 7], [8], []]
    assert groups_t == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert align_by_byte_offsets([(0, 2), (2, 4), (4, 4)], [(0, 4)]) == ([[0, 1], [2]], [[0], []])


def test_two_local_tokenizers_split_digits_differently_and_align(qwen_tok, llama_tok):
    """The Qwen-style tokenizer splits digits one by one, the Llama-style one in runs of up to three: byte spans
    group the student's `1`, `2` with the teacher's `12`."""
    text = "The number 12345 is big."
    s_ids = qwen_tok(text, add_special_tokens=False)["input_ids"]
    _, labels, _, offsets = build_teacher_inputs_from_texts(llama_tok, ["Q: "], [text])
    t_ids = labels[0][labels[0] != -100].tolist()
    assert t_ids[-1] == llama_tok.eos_token_id  # the teacher's eos is appended, with an empty span
    assert len(s_ids) != len(t_ids) - 1
    from trl.experimental._chatml_collator import _completion_byte_offsets

    s_spans = _completion_byte_offsets(qwen_tok, s_ids)
    t_spans = [tuple(span) for span in offsets[0][labels[0] != -100].tolist()]
    assert t_spans[-1] == (len(text), len(text))
    groups_s, groups_t = align_by_byte_offsets(s_spans, t_spans)
    s_text = [qwen_tok.decode([s_ids[i] for i in g]) for g in groups_s if g]
    t_text = [llama_tok.decode([t_ids[i] for i in g]) for g, gs in zip(groups_t, groups_s, strict=True) if gs]
    assert s_text == t_text and "".join(s_text) == text
    assert any(len(g) > 1 for g in groups_s)  # a token split differently by each tokenizer


def test_merge_strategies_match_hand_products():
    probs = torch.softmax(torch.randn(4, 5, generator=torch.Generator().manual_seed(0)), dim=-1)
    ids = torch.tensor([1, 3, 0, 2])
    observed = merge_group_probabilities(probs, [[0], [1, 2]], ids, "observed")
    assert torch.allclose(observed[0], probs[0])
    assert torch.allclose(observed[1], probs[1] * probs[2, 0])
    bayesian = merge_group_probabilities(probs, [[1, 2, 3]], ids, "bayesian")
    assert torch.allclose(bayesian[0], probs[3] * probs[1, 3] * probs[2, 0])
    with pytest.raises(ValueError, match="token_ids must be provided"):
        merge_group_probabilities(probs, [[1, 2]], None)


def split_token_case(seed: int):
    """One row where the student's completion tokens 2 and 3 (bytes 0-2, 2-4) cover the teacher's token 7 (0-4), then
    one token each (4-5) and an end of sequence: logits, labels, ids and byte offsets of both sides."""
    generator = torch.Generator().manual_seed(seed)
    student, teacher = torch.randn(1, 6, 6, generator=generator), torch.randn(1, 6, 8, generator=generator)
    s_ids, t_ids = torch.tensor([[0, 1, 2, 3, 4, 5]]), torch.tensor([[0, 1, 2, 7, 6, 5]])
    s_labels, t_labels = torch.tensor([[-100, -100, 2, 3, 4, 5]]), torch.tensor([[-100, -100, -100, 7, 6, 5]])
    s_off = torch.tensor([[[0, 0], [0, 0], [0, 2], [2, 4], [4, 5], [5, 5]]])
    t_off = torch.tensor([[[0, 0], [0, 0], [0, 0], [0, 4], [4, 5], [5, 5]]])
    return student, teacher, s_labels, t_labels, s_ids, t_ids, s_off, t_off


def test_extended_uld_merges_split_tokens():
    student, teacher, s_labels, t_labels, s_ids, t_ids, s_off, t_off = split_token_case(seed=0)
    loss = ULDLoss(uld_config())(student, teacher, s_labels, t_labels, s_ids, t_ids, s_off, t_off)
    ps = [softmax(row) for row in student[0].tolist()]
    pt = [softmax(row) for row in teacher[0].tolist()]
    merged = [p * ps[3][3] for p in ps[2]]  # student tokens 2 and 3 cover the teacher's token 3
    expected = (hand_sorted_l1(merged, pt[3]) + hand_sorted_l1(ps[4], pt[4])) / 2  # eos pair skipped
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="byte_offsets"):
        ULDLoss(uld_config())(student, teacher, s_labels, t_labels, s_ids, t_ids)


def test_bayesian_merge_reads_each_tokens_predictive_distribution():
    """`bayesian`: a token's distribution is the one that predicted it (logits one position earlier); a split group
    keeps its last token's distribution times the probabilities the earlier tokens were given."""
    student, teacher, s_labels, t_labels, s_ids, t_ids, s_off, t_off = split_token_case(seed=1)
    loss = ULDLoss(uld_config(uld_token_merge_strategy="bayesian"))(
        student, teacher, s_labels, t_labels, s_ids, t_ids, s_off, t_off
    )
    ps = [softmax(row) for row in student[0].tolist()]
    pt = [softmax(row) for row in teacher[0].tolist()]
    # Student tokens 2 (predicted at position 1) and 3 (predicted at 2) cover the teacher's token 7 (predicted at 2).
    merged = [p * ps[1][2] for p in ps[2]]
    expected = (hand_sorted_l1(merged, pt[2]) + hand_sorted_l1(ps[3], pt[3])) / 2  # eos pair skipped
    assert loss.item() == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Hybrid loss
# ---------------------------------------------------------------------------------------------------------------------
def hand_hybrid(p: torch.Tensor, q: torch.Tensor, mapping: dict, beta: float, weights: tuple | None) -> float:
    """Generalized JSD on the shared entries (not renormalised, floored at 1e-8) plus sorted L1 on the rest, per
    position."""
    t_ids = sorted(mapping)
    s_ids = [mapping[t] for t in t_ids]
    s_rest = [i for i in range(p.shape[-1]) if i not in set(s_ids)]
    t_rest = [i for i in range(q.shape[-1]) if i not in set(t_ids)]
    matched, unmatched = [], []
    for row in range(p.shape[0]):
        a, b = p[row, s_ids].double().clamp_min(1e-8), q[row, t_ids].double().clamp_min(1e-8)
        m = (1 - beta) * a + beta * b
        jsd = beta * (b * (b / m).log()).sum() + (1 - beta) * (a * (a / m).log()).sum()
        matched.append(float(jsd))
        unmatched.append(hand_sorted_l1(p[row, s_rest].tolist(), q[row, t_rest].tolist()))
    matched_mean, unmatched_mean = sum(matched) / len(matched), sum(unmatched) / len(unmatched)
    if weights is None:
        share = len(mapping) / q.shape[-1]
        weights = (share, 1 - share)
    return weights[0] * matched_mean + weights[1] * unmatched_mean


@pytest.mark.parametrize(("beta", "weights"), [(0.5, None), (0.2, None), (0.5, (0.3, 0.7))])
@pytest.mark.parametrize("scale", [1.0, 1e-5])  # 1e-5: a merged group's product of probabilities
def test_hybrid_loss_matches_hand_formula(qwen_tok, llama_tok, beta, weights, scale):
    mapping = shared_vocabulary(qwen_tok, llama_tok)
    assert 0 < len(mapping) < len(llama_tok)
    assert all(qwen_tok.convert_ids_to_tokens(s) == llama_tok.convert_ids_to_tokens(t) for t, s in mapping.items())
    extra = (
        {} if weights is None else dict(uld_hybrid_matched_weight=weights[0], uld_hybrid_unmatched_weight=weights[1])
    )
    loss_fn = ULDLoss(uld_config(uld_use_hybrid_loss=True, beta=beta, **extra), qwen_tok, llama_tok)
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, len(qwen_tok), generator=generator) * 2, dim=-1) * scale
    q = torch.softmax(torch.randn(3, len(llama_tok), generator=generator) * 2, dim=-1)
    assert loss_fn.hybrid_loss(p, q).item() == pytest.approx(hand_hybrid(p, q, mapping, beta, weights), rel=1e-4)


def test_hybrid_needs_both_tokenizers():
    with pytest.raises(ValueError, match="both the student and the teacher tokenizer"):
        ULDLoss(uld_config(uld_use_hybrid_loss=True))


# ---------------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------------
def test_same_tokenizer_loss_is_gkds_at_the_sampling_temperature(tmp_path, model_path, conversations):
    """Without ULD, GOLD's loss is GKD's generalized JSD with both models' logits divided by `temperature`."""
    train, test = conversations
    teacher = AutoModelForCausalLM.from_pretrained(model_path)
    perturb(teacher, seed=1, scale=0.05)
    common = dict(model=model_path, teacher_model=teacher, train_dataset=train, eval_dataset=test)
    gold = GOLDTrainer(args=make_args(tmp_path / "gold", temperature=0.7), **common)
    gkd = GKDTrainer(
        args=GKDConfig(str(tmp_path / "gkd"), use_cpu=True, report_to="none", per_device_eval_batch_size=2), **common
    )
    batch = gold.data_collator(list(test))
    gold.model.eval()
    with torch.no_grad():
        gold_loss = gold.compute_loss(gold.model, batch)
        outputs = gkd.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        teacher_logits = gkd.teacher_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = GKDTrainer.generalized_jsd_loss(
        outputs.logits[:, :-1], teacher_logits[:, :-1], labels=batch["labels"][:, 1:], temperature=0.7
    )
    assert gold_loss.item() == pytest.approx(expected.item(), rel=1e-5)
    # As in TRL, evaluation hands `compute_metrics` no predictions or labels, only the loss (GKD: the logits).
    predicted = gold.predict(gold.eval_dataset)
    assert predicted.predictions is None and predicted.label_ids is None
    assert predicted.metrics["test_loss"] == pytest.approx(gold.evaluate()["eval_loss"], rel=1e-6)
    assert gkd.predict(gkd.eval_dataset).predictions.shape[-1] == gkd.model.config.vocab_size


def test_cross_tokenizer_training_changes_student_logs_and_evaluates(tmp_path, model_path, conversations):
    trainer = cross(tmp_path, model_path, conversations, uld_use_hybrid_loss=True)
    assert trainer.teacher_tokenizer.eos_token == "<|eot_id|>"  # the teacher's own tokenizer
    student_before, teacher_before = snapshot(trainer.model), snapshot(trainer.teacher_model)
    trainer.train()
    assert changed_params(student_before, trainer.model)
    assert not changed_params(teacher_before, trainer.teacher_model, trainable_only=False)
    logs = train_logs(trainer)
    assert len(logs) == 2
    for log in logs:
        assert math.isfinite(log["loss"]) and log["off_policy_loss"] == round(log["loss"], 4)
        assert {"matched_loss", "unmatched_loss"} <= set(log) and "on_policy_loss" not in log
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_on_policy_batches_are_realigned_and_logged(tmp_path, model_path, conversations):
    trainer = cross(tmp_path, model_path, conversations, lmbda=1.0, max_steps=1)
    seen = []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        seen.append({k: inputs[k] for k in ("labels", "byte_offsets", "original_completion_text")})
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    trainer.train()
    assert "on_policy_loss" in train_logs(trainer)[0] and "off_policy_loss" not in train_logs(trainer)[0]
    tok = trainer.processing_class
    for labels, offsets, text in zip(seen[0]["labels"], seen[0]["byte_offsets"], seen[0]["original_completion_text"]):
        ids = labels[labels != -100].tolist()
        assert tok.decode(ids) == text  # the generated completion is what the teacher reads
        assert offsets[labels != -100][-1, 1].item() == len(text.encode())


def test_num_generations_samples_each_prompt_several_times(tmp_path, model_path, conversations):
    trainer = cross(tmp_path, model_path, conversations, lmbda=1.0, num_generations=2, per_device_train_batch_size=4)
    seen = []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        seen.append({k: inputs[k] for k in ("prompts", "original_prompt_text", "labels")})
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    assert len(seen) == 2
    for batch in seen:
        prompts = batch["original_prompt_text"]
        # Two prompts per step, each trained on with two completions sampled from the same prompt tokens.
        assert len(prompts) == 4 and prompts[0] == prompts[1] and prompts[2] == prompts[3] and prompts[0] != prompts[2]
        assert torch.equal(batch["prompts"][0], batch["prompts"][1])
        assert (batch["labels"] != -100).any(dim=1).all()
    assert "on_policy_loss" in train_logs(trainer)[0]
    # An epoch is one pass over the prompts: 8 prompts, 2 per step.
    assert trainer.state.log_history[0]["epoch"] == 0.25


def test_datasets_are_tokenized_up_front_and_collated_as_raw_rows(tmp_path, model_path, conversations):
    """As TRL, the datasets get the texts, ids, completion mask and byte offsets as columns; the collator reads them
    and builds the same batch as from the raw conversations."""
    train, test = conversations
    trainer = GOLDTrainer(
        model=model_path, teacher_model=model_path, args=make_args(tmp_path), train_dataset=train, eval_dataset=test
    )
    prepared = trainer.train_dataset
    assert set(prepared.column_names) == {
        "messages",
        "original_prompt_text",
        "original_completion_text",
        "input_ids",
        "attention_mask",
        "byte_offsets",
        "completion_mask",
    }
    assert trainer.eval_dataset.column_names == prepared.column_names
    row = prepared[0]
    tok = trainer.processing_class
    completion = [i for i, keep in zip(row["input_ids"], row["completion_mask"], strict=True) if keep]
    assert tok.decode(completion) == row["original_completion_text"]
    assert row["byte_offsets"][-1][1] == len(row["original_completion_text"].encode())
    assert tok.decode(row["input_ids"]) == row["original_prompt_text"] + row["original_completion_text"]
    from_prepared = trainer.data_collator([prepared[i] for i in range(3)])
    from_raw = trainer.data_collator([train[i] for i in range(3)])
    assert from_prepared.keys() == from_raw.keys()
    for key, value in from_prepared.items():
        assert torch.equal(value, from_raw[key]) if torch.is_tensor(value) else value == from_raw[key]


def test_gradient_accumulation_slices_one_generation_batch_per_step(tmp_path, model_path, conversations):
    """As TRL: the dataloader yields the step's whole generation batch once per micro-step, each micro-step trains on
    its slice, and the JSD is divided by the Trainer's token count over those fetched batches."""
    train, test = conversations
    trainer = GOLDTrainer(
        model=model_path,
        teacher_model=model_path,
        args=make_args(tmp_path, max_steps=2, gradient_accumulation_steps=2),
        train_dataset=train,
        eval_dataset=test,
    )
    fetched, trained = [], []
    training_step, compute_loss = trainer.training_step, trainer.compute_loss

    def record_step(model, inputs, num_items_in_batch=None):
        fetched.append((inputs["labels"].clone(), num_items_in_batch))
        return training_step(model, inputs, num_items_in_batch)

    def record_loss(model, inputs, *args, **kwargs):
        trained.append(inputs["labels"])
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.training_step, trainer.compute_loss = record_step, record_loss
    trainer.train()
    assert len(fetched) == len(trained) == 4
    for step in (0, 2):
        (batch, count), (again, _) = fetched[step], fetched[step + 1]
        assert torch.equal(batch, again) and batch.shape[0] == 4  # per_device_train_batch_size * accumulation
        assert torch.equal(torch.cat(trained[step : step + 2]), batch)  # the two slices, padding kept
        assert count == 2 * (batch != -100).sum()
    # Two steps of 4 distinct prompts each: one pass over the 8 training prompts.
    assert trainer.state.epoch == 1.0


def test_log_completions_prints_and_writes_the_step_completions(tmp_path, model_path, conversations, capsys):
    import pandas as pd

    trainer = cross(
        tmp_path, model_path, conversations, lmbda=1.0, max_steps=3, log_completions=True, log_completions_steps=2
    )
    generated = []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        generated.append(list(zip(inputs["original_prompt_text"], inputs["original_completion_text"], strict=True)))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    trainer.train()
    out = capsys.readouterr().out
    assert "Prompt" in out and "Completion" in out and "Step 2" in out
    assert "Step 1" not in out and "Step 3" not in out  # only every log_completions_steps
    files = sorted((tmp_path / "completions").iterdir())
    assert [f.name for f in files] == ["completions_00002.parquet"]
    frame = pd.read_parquet(files[0])
    assert list(frame.columns) == ["prompt", "completion", "step"]
    assert (frame["step"] == 2).all()
    # The second step's generations, one row per distinct prompt (wandb_log_unique_prompts=True by default).
    expected = [pair for i, pair in enumerate(generated[1]) if pair[0] not in [p for p, _ in generated[1][:i]]]
    assert list(zip(frame["prompt"], frame["completion"], strict=True)) == expected


def test_no_completions_logged_by_default(tmp_path, model_path, conversations, capsys):
    trainer = cross(tmp_path, model_path, conversations, lmbda=1.0, max_steps=1)
    trainer.train()
    assert "Completion" not in capsys.readouterr().out
    assert not (tmp_path / "completions").exists()


def test_resume_from_checkpoint(tmp_path, model_path, conversations):
    train, _ = conversations
    args = make_args(tmp_path, use_uld_loss=True, save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(
        GOLDTrainer, args, tmp_path, model=model_path, teacher_model=LLAMA, train_dataset=train
    )


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"seq_kd": True}, ValueError, "seq_kd"),
        ({"callbacks": ["BEMACallback"]}, ValueError, "callback instances"),
    ],
)
def test_bad_input_fails_before_training(tmp_path, model_path, conversations, overrides, error, match):
    with pytest.raises(error, match=match):
        cross(tmp_path, model_path, conversations, **overrides)


def test_other_tokenizer_without_uld_is_rejected(tmp_path, model_path, conversations):
    train, _ = conversations
    with pytest.raises(ValueError, match="differs from the student's"):
        GOLDTrainer(model=model_path, teacher_model=LLAMA, args=make_args(tmp_path), train_dataset=train)


def test_hybrid_without_uld_is_rejected(tmp_path, model_path, conversations):
    train, _ = conversations
    with pytest.raises(ValueError, match="use_uld_loss=True"):
        GOLDTrainer(
            model=model_path,
            teacher_model=LLAMA,
            args=make_args(tmp_path, uld_use_hybrid_loss=True),
            train_dataset=train,
        )


def test_gkd_config_is_rejected(tmp_path, model_path, conversations):
    with pytest.raises(TypeError, match="GOLDConfig"):
        GOLDTrainer(model=model_path, teacher_model=LLAMA, args=GKDConfig(str(tmp_path)))


# ---------------------------------------------------------------------------------------------------------------------
# vLLM (`make test-vllm`: the vLLM environment)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.skipif(not is_vllm_available(), reason="needs vLLM (`make test-vllm` builds its environment)")
def test_vllm_colocate_generates_the_on_policy_completions(tmp_path, model_path, conversations):
    """With use_vllm, the on-policy completions come from the colocated engine (weights pushed every step), are
    realigned for the teacher's tokenizer and trained on."""
    trainer = cross(
        tmp_path,
        model_path,
        conversations,
        lmbda=1.0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=256,
    )
    assert trainer.vllm_generation is not None
    calls, seen = [], []
    generate, compute_loss = trainer.vllm_generation.generate, trainer.compute_loss

    def recording_generate(prompt_ids, model=None, weights_version=None):
        output = generate(prompt_ids, model=model, weights_version=weights_version)
        calls.append((weights_version, output["completion_ids"]))
        return output

    def recording_loss(model, inputs, *args, **kwargs):
        seen.append({k: inputs[k] for k in ("labels", "byte_offsets", "original_completion_text")})
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.vllm_generation.generate, trainer.compute_loss = recording_generate, recording_loss
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    assert [version for version, _ in calls] == [0, 1]  # one generation per step, after each weight update
    tok = trainer.processing_class
    for (_, completions), batch in zip(calls, seen, strict=True):
        for ids, labels, text in zip(completions, batch["labels"], batch["original_completion_text"], strict=True):
            assert 0 < len(ids) <= 6 and labels[labels != -100].tolist() == ids
            assert tok.decode(ids) == text
    logs = train_logs(trainer)
    assert len(logs) == 2 and all("on_policy_loss" in log and math.isfinite(log["loss"]) for log in logs)
    trainer.vllm_generation.close()

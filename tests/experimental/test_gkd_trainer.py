"""Experimental GKDTrainer: config, ChatML collator, loss against a hand formula, the data source of each batch
(dataset, student or teacher generations), training, checkpoints, and distillation moving the student to the teacher."""

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

from trl.assets import get_model_path, load_test_dataset
from trl.experimental.gkd import GKDConfig, GKDTrainer
from trl.experimental.utils import DataCollatorForChatML


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(
    GKDConfig, max_steps=2, per_device_train_batch_size=2, per_device_eval_batch_size=2, max_new_tokens=6, seed=0
)


@pytest.fixture(scope="module")
def conversations():
    data = load_test_dataset("conversational_language_modeling")
    return data["train"].select(range(8)), data["test"].select(range(4))


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory, model_path):
    """The tiny model with perturbed weights, saved: a teacher sharing the student's tokenizer but not its outputs."""
    teacher = AutoModelForCausalLM.from_pretrained(model_path)
    perturb(teacher, seed=1, scale=0.05)
    path = tmp_path_factory.mktemp("teacher")
    teacher.save_pretrained(path)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(path)
    return str(path)


def build(tmp_path, model_path, teacher_path, conversations, **overrides):
    train, test = conversations
    return GKDTrainer(
        model=model_path,
        teacher_model=teacher_path,
        args=make_args(tmp_path, **overrides),
        train_dataset=train,
        eval_dataset=test,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------
def test_config_defaults_match_contract():
    args = GKDConfig("out")
    assert (args.temperature, args.lmbda, args.beta, args.max_new_tokens) == (0.9, 0.5, 0.5, 128)
    assert args.teacher_model_name_or_path is None and args.teacher_model_init_kwargs is None
    assert args.disable_dropout is True and args.seq_kd is False
    assert args.learning_rate == 2e-5 and args.max_length == 1024  # inherited from SFTConfig


@pytest.mark.parametrize(
    ("field", "value"), [("lmbda", 1.5), ("lmbda", -0.1), ("beta", 2.0), ("temperature", 0.0), ("max_new_tokens", 0)]
)
def test_config_rejects_out_of_range_values(field, value):
    with pytest.raises(ValueError, match=field):
        GKDConfig("out", **{field: value})


# ---------------------------------------------------------------------------------------------------------------------
# Collator
# ---------------------------------------------------------------------------------------------------------------------
def test_collator_marks_the_last_assistant_turn(tokenizer):
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "A."},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Yes it is."},
    ]
    short = [{"role": "user", "content": "Is ice cold?"}, {"role": "assistant", "content": "Yes."}]
    batch = DataCollatorForChatML(tokenizer)([{"messages": conversation}, {"messages": short}])
    prompt_text = tokenizer.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(conversation, tokenize=False)
    full_ids = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]

    assert batch["input_ids"][0].tolist() == full_ids  # the longest row has no padding
    assert batch["labels"][0].tolist() == [-100] * len(prompt_ids) + full_ids[len(prompt_ids) :]
    assert batch["prompts"][0].tolist() == prompt_ids
    # Left padding everywhere: the short row ends where the long one does.
    assert batch["attention_mask"][1, 0] == 0 and batch["attention_mask"][1, -1] == 1
    assert (batch["input_ids"][1][batch["attention_mask"][1] == 0] == tokenizer.pad_token_id).all()
    assert batch["prompt_attention_mask"][1, -1] == 1
    completion = tokenizer.decode(batch["labels"][1][batch["labels"][1] != -100])
    assert completion.startswith("Yes.")
    # Byte offsets tile the completion text.
    offsets = batch["byte_offsets"][0][len(prompt_ids) :]
    assert offsets[0, 0] == 0 and (offsets[1:, 0] == offsets[:-1, 1]).all()
    assert offsets[-1, 1] == len(full_text[len(prompt_text) :].encode("utf-8"))


def test_collator_truncates_the_prompt_from_the_left(tokenizer):
    example = {"messages": [{"role": "user", "content": "Is ice cold?"}, {"role": "assistant", "content": "Yes."}]}
    full = DataCollatorForChatML(tokenizer)([example])
    cut = DataCollatorForChatML(tokenizer, max_length=10)([example])
    assert cut["input_ids"][0].tolist() == full["input_ids"][0, -10:].tolist()
    assert cut["labels"][0].tolist() == full["labels"][0, -10:].tolist()
    assert cut["prompts"][0].tolist() == full["prompts"][0, -(10 - int((full["labels"] != -100).sum())) :].tolist()
    with pytest.raises(ValueError, match="max_length"):
        DataCollatorForChatML(tokenizer, max_length=3)([example])


def test_collator_accepts_prompt_completion_and_rejects_other_rows(tokenizer):
    prompt = [{"role": "user", "content": "Is ice cold?"}]
    completion = [{"role": "assistant", "content": "Yes."}]
    collator = DataCollatorForChatML(tokenizer)
    from_pair = collator([{"prompt": prompt, "completion": completion}])
    from_messages = collator([{"messages": prompt + completion}])
    for key in from_pair:
        assert torch.equal(from_pair[key], from_messages[key]), key
    with pytest.raises(ValueError, match="messages"):
        collator([{"text": "hello"}])


# ---------------------------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------------------------
def hand_jsd(student_row: list, teacher_row: list, beta: float) -> float:
    """Generalized JSD of one position from raw logits, with explicit softmax and sums."""
    p_s = [math.exp(z) for z in student_row]
    p_t = [math.exp(z) for z in teacher_row]
    p_s = [p / sum(p_s) for p in p_s]
    p_t = [p / sum(p_t) for p in p_t]

    def kl(p, q):
        return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0)

    if beta == 0:
        return kl(p_t, p_s)
    if beta == 1:
        return kl(p_s, p_t)
    mixture = [(1 - beta) * s + beta * t for s, t in zip(p_s, p_t, strict=True)]
    return beta * kl(p_t, mixture) + (1 - beta) * kl(p_s, mixture)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_eval_loss_is_the_token_average_divergence_on_completions(
    tmp_path, model_path, teacher_path, conversations, beta
):
    trainer = build(tmp_path, model_path, teacher_path, conversations, beta=beta, per_device_eval_batch_size=4)
    batch = trainer.data_collator(list(conversations[1]))
    student = AutoModelForCausalLM.from_pretrained(model_path).double()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path).double()
    with torch.no_grad():
        s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    values = []
    for row in range(batch["labels"].shape[0]):
        for pos in range(batch["labels"].shape[1] - 1):
            if batch["labels"][row, pos + 1] != -100:  # position pos predicts token pos + 1
                values.append(hand_jsd(s_logits[row, pos].tolist(), t_logits[row, pos].tolist(), beta))
    assert trainer.evaluate()["eval_loss"] == pytest.approx(sum(values) / len(values), rel=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# Where each batch's completions come from
# ---------------------------------------------------------------------------------------------------------------------
def record_batches(trainer):
    """Count `generate` calls of student and teacher and record the labels of every training batch."""
    calls = {"student": 0, "teacher": 0}
    outputs = {"student": [], "teacher": []}
    for role, model in (("student", trainer.model), ("teacher", trainer.teacher_model)):
        original = model.generate

        def counted(*args, _role=role, _original=original, **kwargs):
            calls[_role] += 1
            result = _original(*args, **kwargs)
            outputs[_role].append(result.clone())
            return result

        model.generate = counted
    labels = []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        if trainer.model.training:
            labels.append(inputs["labels"].clone())
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    return calls, outputs, labels


def assert_labels_are_generated(labels, generated, max_new_tokens=6):
    """The trained tokens are exactly the generated ones: only in the last `max_new_tokens` columns, equal to the
    sampled sequences there, and every sampled token up to the first end of turn is kept."""
    assert len(labels) == len(generated) > 0
    for batch_labels, sequences in zip(labels, generated, strict=True):
        assert batch_labels.shape == sequences.shape
        kept = batch_labels != -100
        assert kept[:, :-max_new_tokens].sum() == 0 and kept.any(dim=1).all()
        assert torch.equal(batch_labels[kept], sequences[kept])


def test_lmbda_zero_never_generates(tmp_path, model_path, teacher_path, conversations):
    trainer = build(tmp_path, model_path, teacher_path, conversations, lmbda=0.0)
    calls, _, labels = record_batches(trainer)
    trainer.train()
    assert calls == {"student": 0, "teacher": 0}
    dataset_labels = trainer.data_collator(list(conversations[0]))["labels"]
    completions = {tuple(row[row != -100].tolist()) for row in dataset_labels}
    assert len(labels) == 2
    assert all(tuple(row[row != -100].tolist()) in completions for batch in labels for row in batch)


def test_lmbda_one_trains_only_on_student_generations(tmp_path, model_path, teacher_path, conversations):
    trainer = build(tmp_path, model_path, teacher_path, conversations, lmbda=1.0, seq_kd=True)
    calls, outputs, labels = record_batches(trainer)
    trainer.train()
    assert calls == {"student": 2, "teacher": 0}  # on-policy batches skip the teacher's generation
    assert len(labels) == 2
    assert_labels_are_generated(labels, outputs["student"])
    assert all(0 < int((lab != -100).sum()) <= 2 * 6 for lab in labels)  # at most max_new_tokens per row


def test_seq_kd_trains_on_teacher_generations(tmp_path, model_path, teacher_path, conversations):
    trainer = build(tmp_path, model_path, teacher_path, conversations, lmbda=0.0, seq_kd=True)
    calls, outputs, labels = record_batches(trainer)
    trainer.train()
    assert calls == {"student": 0, "teacher": 2}
    assert_labels_are_generated(labels, outputs["teacher"])


def test_lmbda_between_draws_per_batch(tmp_path, model_path, teacher_path, conversations):
    trainer = build(tmp_path, model_path, teacher_path, conversations, lmbda=0.5, max_steps=4)
    calls, _, _ = record_batches(trainer)
    trainer.train()
    assert calls["teacher"] == 0 and 0 <= calls["student"] <= 4


# ---------------------------------------------------------------------------------------------------------------------
# Training, evaluation, checkpoints
# ---------------------------------------------------------------------------------------------------------------------
def test_training_changes_student_only_logs_and_evaluates(tmp_path, model_path, teacher_path, conversations):
    trainer = build(tmp_path, model_path, teacher_path, conversations, lmbda=0.5, learning_rate=1e-2)
    student_before, teacher_before = snapshot(trainer.model), snapshot(trainer.teacher_model)
    trainer.train()
    assert changed_params(student_before, trainer.model)
    assert not changed_params(teacher_before, trainer.teacher_model, trainable_only=False)
    assert all(not p.requires_grad for p in trainer.teacher_model.parameters()) and not trainer.teacher_model.training
    logs = train_logs(trainer)
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] >= 0
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_resume_from_checkpoint(tmp_path, model_path, teacher_path, conversations):
    train, test = conversations
    args = make_args(tmp_path, lmbda=0.0, save_strategy="steps", save_steps=1, learning_rate=1e-2)
    resume_from_first_checkpoint(
        GKDTrainer, args, tmp_path, model=model_path, teacher_model=teacher_path, train_dataset=train
    )


def test_distillation_moves_the_student_toward_a_trained_teacher(tmp_path, model_path, conversations):
    """A teacher fine-tuned on the conversations, then 30 GKD steps: the divergence on held-out prompts falls."""
    from trl import SFTConfig, SFTTrainer

    data = load_test_dataset("conversational_language_modeling")
    teacher = SFTTrainer(
        model=model_path,
        args=SFTConfig(
            output_dir=str(tmp_path / "teacher"),
            max_steps=30,
            learning_rate=1e-2,
            per_device_train_batch_size=8,
            seed=0,
            report_to="none",
            save_strategy="no",
            logging_steps=30,
            gradient_checkpointing=False,
            disable_tqdm=True,
        ),
        train_dataset=data["train"],
    )
    teacher.train()
    held_out = data["test"]
    trainer = GKDTrainer(
        model=model_path,
        teacher_model=teacher.model,
        args=make_args(tmp_path, lmbda=0.0, beta=0.5, max_steps=30, learning_rate=5e-3, per_device_train_batch_size=8),
        train_dataset=data["train"],
        eval_dataset=held_out,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < 0.5 * before


# ---------------------------------------------------------------------------------------------------------------------
# Teacher loading and bad input
# ---------------------------------------------------------------------------------------------------------------------
def test_teacher_from_config_path_with_init_kwargs(tmp_path, model_path, teacher_path, conversations):
    args = make_args(
        tmp_path, teacher_model_name_or_path=teacher_path, teacher_model_init_kwargs={"dtype": "bfloat16"}
    )
    trainer = GKDTrainer(model=model_path, args=args, train_dataset=conversations[0])
    assert trainer.teacher_model.dtype == torch.bfloat16


def test_teacher_with_another_tokenizer_is_rejected(tmp_path, model_path, conversations):
    with pytest.raises(ValueError, match="tokenizer .* differs from the student"):
        GKDTrainer(
            model=model_path,
            teacher_model=get_model_path("tiny-LlamaForCausalLM"),
            args=make_args(tmp_path),
            train_dataset=conversations[0],
        )


def test_teacher_with_another_vocabulary_size_is_rejected(tmp_path, model_path, conversations):
    teacher = AutoModelForCausalLM.from_pretrained(model_path)
    teacher.resize_token_embeddings(teacher.config.vocab_size + 8)
    with pytest.raises(ValueError, match=r"4104 entries but the student's has 4096"):
        GKDTrainer(model=model_path, teacher_model=teacher, args=make_args(tmp_path), train_dataset=conversations[0])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"teacher_model": None}, ValueError, "teacher"),
        ({"formatting_func": lambda ex: "x"}, ValueError, "formatting_func"),
        (
            {"args_overrides": {"teacher_model_init_kwargs": {"dtype": "float32"}}, "instance": True},
            ValueError,
            "init",
        ),
        ({"args_overrides": {"packing": True}}, ValueError, "packing"),
    ],
)
def test_bad_input_fails_before_training(tmp_path, model_path, teacher_path, conversations, kwargs, error, match):
    kwargs = dict(kwargs)
    overrides = kwargs.pop("args_overrides", {})
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path) if kwargs.pop("instance", False) else teacher_path
    kwargs.setdefault("teacher_model", teacher)
    with pytest.raises(error, match=match):
        GKDTrainer(model=model_path, args=make_args(tmp_path, **overrides), train_dataset=conversations[0], **kwargs)


def test_plain_sft_config_is_rejected(tmp_path, model_path, teacher_path, conversations):
    from trl import SFTConfig

    with pytest.raises(TypeError, match="GKDConfig"):
        GKDTrainer(
            model=model_path,
            teacher_model=teacher_path,
            args=SFTConfig(str(tmp_path), report_to="none"),
            train_dataset=conversations[0],
        )


def test_static_loss_is_the_shared_divergence():
    from trl.trainer.utils import generalized_jsd_loss

    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 3, 5, generator=generator), torch.randn(2, 3, 5, generator=generator)
    labels = torch.tensor([[-100, 1, 2], [3, 4, -100]])
    assert torch.equal(
        GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=0.2),
        generalized_jsd_loss(student, teacher, labels, beta=0.2),
    )


def test_peft_student_trains_only_its_adapters(tmp_path, model_path, teacher_path, conversations):
    from peft import LoraConfig
    from trainer_utils import TINY_LORA

    trainer = GKDTrainer(
        model=model_path,
        teacher_model=teacher_path,
        args=make_args(tmp_path, lmbda=0.5, learning_rate=1e-2),
        train_dataset=conversations[0],
        peft_config=LoraConfig(**TINY_LORA),
    )
    before = snapshot(trainer.model)
    trainer.train()
    changed = changed_params(before, trainer.model)
    assert changed and all("lora" in name for name in changed)

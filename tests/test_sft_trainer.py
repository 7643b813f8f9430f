"""SFTTrainer: data preparation, losses, packing, padding-free, metrics, saving and resuming."""

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset, IterableDataset
from trainer_utils import SGD_STEP_ARGS, args_builder, changed_params, sgd_step_update, snapshot
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from trl import SFTConfig, SFTTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling


MODEL = "tiny-Qwen2ForCausalLM"


make_args = args_builder(
    SFTConfig, max_steps=3, per_device_train_batch_size=2, per_device_eval_batch_size=2, learning_rate=1e-2
)


def assert_params_changed(before, model, only_trainable=True):
    changed = changed_params(before, model, trainable_only=only_trainable)
    assert changed, "no parameter changed during training"
    return changed


# ---------------------------------------------------------------------------------------------------------------------
# Training on every dataset format
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config_name",
    [
        "standard_language_modeling",
        "standard_prompt_completion",
        "conversational_language_modeling",
        "conversational_prompt_completion",
    ],
)
def test_train_each_format(tmp_path, model_path, config_name):
    dataset = load_test_dataset(config_name)
    args = make_args(tmp_path, eval_strategy="steps", eval_steps=3)
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=dataset["train"], eval_dataset=dataset["test"])
    before = snapshot(trainer.model)
    trainer.train()
    assert_params_changed(before, trainer.model)
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(train_logs) == 3
    for key in ("loss", "entropy", "num_tokens", "mean_token_accuracy"):
        assert key in train_logs[-1], key
    assert train_logs[-1]["num_tokens"] > train_logs[0]["num_tokens"] > 0
    eval_logs = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert eval_logs and "eval_mean_token_accuracy" in eval_logs[-1] and "eval_entropy" in eval_logs[-1]
    assert 0.0 <= train_logs[-1]["mean_token_accuracy"] <= 1.0


def test_default_config_trains_with_gradient_checkpointing(tmp_path, model_path, monkeypatch):
    """The contract defaults (gradient checkpointing on, bf16=None) start on a CPU-only machine without extra flags."""
    monkeypatch.chdir(tmp_path)
    dataset = load_test_dataset("standard_language_modeling", split="train")
    trainer = SFTTrainer(model=model_path, train_dataset=dataset.select(range(4)))
    assert trainer.args.output_dir.endswith(f"{MODEL}-SFT")
    assert trainer.args.gradient_checkpointing is True
    assert trainer.args.bf16 is False  # no accelerator here
    trainer.args.max_steps = 1
    trainer.args.report_to = []
    trainer.train()
    assert trainer.state.global_step == 1


def test_training_arguments_are_converted(tmp_path, model_path):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", hub_token="secret-token")
    dataset = load_test_dataset("standard_language_modeling", split="train").select(range(4))
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=dataset)
    assert isinstance(trainer.args, SFTConfig)
    assert trainer.args.hub_token == "secret-token"
    assert trainer.args.max_steps == 1


def test_model_instance_and_pretokenized(tmp_path, model_path, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    rows = [tokenizer(f"The number {i} is followed by {i + 1}.")["input_ids"] for i in range(8)]
    dataset = Dataset.from_dict({"input_ids": rows})
    trainer = SFTTrainer(model=model, args=make_args(tmp_path), train_dataset=dataset, processing_class=tokenizer)
    # pre-tokenized ids are kept as they are (no EOS appended)
    assert trainer.train_dataset[0]["input_ids"] == rows[0]
    before = snapshot(model)
    trainer.train()
    assert_params_changed(before, trainer.model)


def test_formatting_func(tmp_path, model_path):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    trainer = SFTTrainer(
        model=model_path,
        args=make_args(tmp_path, max_steps=1),
        train_dataset=dataset,
        formatting_func=lambda ex: f"Q: {ex['text']}",
    )
    tokenizer = trainer.processing_class
    row = trainer.train_dataset[0]
    # As in TRL: the formatted text replaces the `text` column (with EOS) and is what gets tokenized.
    assert trainer.train_dataset.column_names == ["text", "input_ids", "labels"]
    assert row["text"] == f"Q: {dataset[0]['text']}{tokenizer.eos_token}"
    assert tokenizer.decode(row["input_ids"]) == row["text"]
    trainer.train()


def test_formatting_func_on_prompt_completion_data_needs_completion_only_loss_false(tmp_path, model_path):
    dataset = load_test_dataset("standard_prompt_completion", split="train")
    formatting_func = lambda ex: f"Q: {ex['prompt']} A: {ex['completion']}"  # noqa: E731
    # completion_only_loss=None means "on" for prompt-completion data, which a formatting function contradicts (TRL)
    with pytest.raises(ValueError, match="formatting function was provided"):
        SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset, formatting_func=formatting_func)
    trainer = SFTTrainer(
        model=model_path,
        args=make_args(tmp_path, completion_only_loss=False),
        train_dataset=dataset,
        formatting_func=formatting_func,
    )
    assert trainer.train_dataset.column_names == [
        "prompt",
        "completion",
        "text",
        "input_ids",
        "completion_mask",
        "labels",
    ]


def test_iterable_dataset(tmp_path, model_path):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    iterable = dataset.to_iterable_dataset()
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path, max_steps=2), train_dataset=iterable)
    assert isinstance(trainer.train_dataset, IterableDataset)
    trainer.train()
    assert trainer.state.global_step == 2


def test_iterable_dataset_requires_max_steps(tmp_path, model_path):
    iterable = load_test_dataset("standard_language_modeling", split="train").to_iterable_dataset()
    with pytest.raises(ValueError, match="max_steps"):
        SFTTrainer(model=model_path, args=make_args(tmp_path, max_steps=-1), train_dataset=iterable)


def test_eval_dataset_dict(tmp_path, model_path):
    lm = load_test_dataset("standard_language_modeling")
    pc = load_test_dataset("standard_prompt_completion")
    trainer = SFTTrainer(
        model=model_path,
        args=make_args(tmp_path, max_steps=1),
        train_dataset=lm["train"],
        eval_dataset={"lm": lm["test"], "pc": pc["test"]},
    )
    metrics = trainer.evaluate()
    assert "eval_lm_loss" in metrics and "eval_pc_loss" in metrics
    logged = [log for log in trainer.state.log_history if "eval_lm_loss" in log or "eval_pc_loss" in log]
    assert len(logged) == 2 and all("eval_mean_token_accuracy" in log for log in logged)


def test_sharegpt_conversations_are_converted(tmp_path, model_path):
    rows = {
        "conversations": [
            [{"from": "user", "value": f"What is {i} plus 1?"}, {"from": "assistant", "value": str(i + 1)}]
            for i in range(6)
        ]
    }
    trainer = SFTTrainer(
        model=model_path, args=make_args(tmp_path, max_steps=1), train_dataset=Dataset.from_dict(rows)
    )
    text = trainer.processing_class.decode(trainer.train_dataset[0]["input_ids"])
    assert "What is 0 plus 1?" in text and "<|im_start|>assistant" in text
    trainer.train()


# ---------------------------------------------------------------------------------------------------------------------
# Labels: EOS, completion-only, assistant-only, truncation
# ---------------------------------------------------------------------------------------------------------------------
def test_eos_appended_and_trained_on(tmp_path, model_path, tokenizer):
    dataset = Dataset.from_dict({"text": ["The sky is blue.", "Grass is green."]})
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    row = trainer.train_dataset[0]
    assert row["input_ids"] == tokenizer("The sky is blue." + tokenizer.eos_token)["input_ids"]
    assert row["input_ids"][-1] == tokenizer.eos_token_id
    assert row["labels"][-1] == tokenizer.eos_token_id  # the model learns to stop


def test_completion_only_loss_masks_prompt(tmp_path, model_path, tokenizer):
    dataset = Dataset.from_dict({"prompt": ["The capital of France is"], "completion": [" Paris."]})
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    row = trainer.train_dataset[0]
    prompt_ids = tokenizer("The capital of France is")["input_ids"]
    full_ids = tokenizer("The capital of France is Paris." + tokenizer.eos_token)["input_ids"]
    assert row["input_ids"] == full_ids
    assert row["labels"] == [-100] * len(prompt_ids) + full_ids[len(prompt_ids) :]

    # completion_only_loss=False trains on the whole sequence
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path, completion_only_loss=False), train_dataset=dataset)
    assert trainer.train_dataset[0]["labels"] == full_ids


def test_conversational_prompt_completion_split_at_generation_prompt(tmp_path, model_path, tokenizer):
    prompt = [{"role": "user", "content": "What colour is the sky?"}]
    completion = [{"role": "assistant", "content": "Blue."}]
    dataset = Dataset.from_dict({"prompt": [prompt], "completion": [completion]})
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    row = trainer.train_dataset[0]
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    n_prompt = len(prompt_ids)
    assert row["input_ids"][:n_prompt] == list(prompt_ids)
    assert all(label == -100 for label in row["labels"][:n_prompt])
    trained = tokenizer.decode([t for t in row["labels"] if t != -100])
    assert trained.startswith("Blue.") and "<|im_end|>" in trained


def test_assistant_only_loss_with_training_template(tmp_path, model_path):
    from trl.chat_template_utils import get_training_chat_template

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = get_training_chat_template(tokenizer)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Say bye."},
        {"role": "assistant", "content": "Bye."},
    ]
    dataset = Dataset.from_dict({"messages": [messages] * 4})
    trainer = SFTTrainer(
        model=model_path,
        args=make_args(tmp_path, assistant_only_loss=True, max_steps=1),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    labels = trainer.train_dataset[0]["labels"]
    trained = tokenizer.decode([t for t in labels if t != -100])
    assert "Hi." in trained and "Bye." in trained
    assert "Say hi." not in trained and "Be brief." not in trained
    trainer.train()


def test_assistant_only_loss_without_markers_swaps_in_the_training_template(tmp_path, model_path):
    # A model family's template without generation markers: TRL's training variant of the family is used for
    # tokenizing, and the tokenizer keeps its own template.
    from trl import chat_template_utils

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = chat_template_utils.qwen2_5_chat_template
    dataset = load_test_dataset("conversational_language_modeling", split="train")
    trainer = SFTTrainer(
        model=model_path,
        args=make_args(tmp_path, assistant_only_loss=True, max_steps=1),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    assert trainer.processing_class.chat_template == chat_template_utils.qwen2_5_chat_template
    row = trainer.train_dataset[0]
    assert 0 < sum(label != -100 for label in row["labels"]) < len(row["labels"])
    trainer.train()


def test_assistant_only_loss_with_the_test_tokenizer_names_its_training_template(tmp_path, model_path):
    # As in TRL, the offline test tokenizers' own template is not swapped automatically.
    dataset = load_test_dataset("conversational_language_modeling", split="train")
    with pytest.raises(ValueError, match=r"generation.*tiny_qwen2_5_training\.jinja"):
        SFTTrainer(model=model_path, args=make_args(tmp_path, assistant_only_loss=True), train_dataset=dataset)


def test_assistant_only_loss_with_an_unknown_template_is_refused(tmp_path, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    dataset = load_test_dataset("conversational_language_modeling", split="train")
    with pytest.raises(ValueError, match=r"assistant_only_loss=True needs .*generation.*not recognised"):
        SFTTrainer(
            model=model_path,
            args=make_args(tmp_path, assistant_only_loss=True),
            train_dataset=dataset,
            processing_class=tokenizer,
        )


def test_chat_template_path_jinja_file(tmp_path, model_path):
    import trl

    template = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "tiny_qwen2_5_training.jinja")
    dataset = load_test_dataset("conversational_language_modeling", split="train")
    trainer = SFTTrainer(
        model=model_path,
        args=make_args(tmp_path, assistant_only_loss=True, chat_template_path=template, max_steps=1),
        train_dataset=dataset,
    )
    assert "generation" in trainer.processing_class.chat_template
    trainer.train()


def test_tools_column(tmp_path, model_path):
    dataset = load_test_dataset("conversational_language_modeling_tools", split="train")
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path, max_steps=1), train_dataset=dataset)
    text = trainer.processing_class.decode(trainer.train_dataset[0]["input_ids"])
    assert "<tools>" in text or "tool_call" in text
    trainer.train()


def test_truncation_is_logged(tmp_path, model_path, caplog):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    with caplog.at_level(logging.WARNING, logger="trl.trainer.sft_trainer"):
        trainer = SFTTrainer(model=model_path, args=make_args(tmp_path, max_length=8), train_dataset=dataset)
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == 8
    assert any("Truncating" in record.getMessage() for record in caplog.records)


# ---------------------------------------------------------------------------------------------------------------------
# Losses against hand-written formulas
# ---------------------------------------------------------------------------------------------------------------------
def _manual_losses(model, batch):
    """Per-token NLL computed independently: full log-softmax, shift, gather, mask."""
    with torch.no_grad():
        kwargs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
        logits = model(**kwargs).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    token_logp = torch.gather(logprobs, 2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return token_logp, mask


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_loss_matches_hand_written_formula(tmp_path, model_path, loss_type):
    dataset = load_test_dataset("standard_prompt_completion", split="train").select(range(4))
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path, loss_type=loss_type), train_dataset=dataset)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    token_logp, mask = _manual_losses(trainer.model, batch)
    if loss_type == "nll":
        expected = -(token_logp * mask).sum() / mask.sum()
    else:
        expected = -(token_logp.exp() * token_logp * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_label_smoothing_matches_hand_written_formula(tmp_path, model_path):
    """`label_smoothing_factor=ε` (transformers' label smoothing, which TRL's SFT loss goes through):
    `(1 - ε)` times the NLL plus `ε` times minus the mean log-probability over the vocabulary, per target token."""
    dataset = load_test_dataset("standard_prompt_completion", split="train").select(range(4))
    args = make_args(tmp_path, label_smoothing_factor=0.1)
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=dataset)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        kwargs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        logprobs = torch.log_softmax(trainer.model(**kwargs).logits.float()[:, :-1], dim=-1)
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    nll = -torch.gather(logprobs, 2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    uniform = -logprobs.mean(dim=-1)
    expected = ((0.9 * nll + 0.1 * uniform) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Packing and padding-free
# ---------------------------------------------------------------------------------------------------------------------
def test_collator_padding_free_layout():
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    batch = collator(
        [
            {"input_ids": [1, 2, 3], "seq_lengths": [3]},
            {"input_ids": [4, 5], "seq_lengths": [2]},
            {"input_ids": [6, 7, 8, 9], "seq_lengths": [1, 3]},
        ]
    )
    assert list(batch) == [
        "input_ids",
        "labels",
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
    ]
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, 8, 9]]
    # sequence boundaries for variable-length attention kernels (TRL's keys, dtypes and values)
    assert batch["cu_seq_lens_q"].dtype == batch["cu_seq_lens_k"].dtype == torch.int32
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 5, 6, 9]
    assert batch["max_length_q"] == batch["max_length_k"] == 3 and isinstance(batch["max_length_q"], int)
    assert batch["seq_idx"].dtype == torch.int32
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 3, 3, 3]]


def test_collator_seq_lengths_read_from_the_first_example_only():
    # As in TRL: `seq_lengths` is used when the first example has it; otherwise each example is one sequence.
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    batch = collator([{"input_ids": [1, 2]}, {"input_ids": [3, 4, 5], "seq_lengths": [1, 2]}])
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 5]


def test_collator_padding_free_pad_to_multiple_of():
    # Every padding token is a sequence of its own at position 0 (TRL's layout).
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=4)
    batch = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 7, 8]
    assert batch["max_length_q"] == 3
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 3, 4]]


def test_collator_get_position_ids_from_packed_seq_lengths():
    get = DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths  # a staticmethod, as in TRL
    result = get([[3, 2], [4]])
    assert [t.tolist() for t in result] == [[0, 1, 2, 0, 1], [0, 1, 2, 3]]
    assert all(t.dtype == torch.long for t in result)


def test_collator_padding_free_rows_bounded_for_dense_attention():
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, max_row_length=5)
    batch = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7, 8, 9]}])
    # first fit, longest first: [6..9] alone, [1, 2, 3] + [4, 5]; the padding token is a sequence of its own
    assert batch["input_ids"].tolist() == [[6, 7, 8, 9, 0], [1, 2, 3, 4, 5]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 7, 8, 9, -100], [-100, 2, 3, -100, 5]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 5, 8, 10]
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 0, 1], [2, 2, 2, 3, 3]]


def test_collator_packed_rows_without_padding_free_keep_labels():
    # As in TRL: a padded batch of packed rows restarts the positions but leaves the labels as they are.
    collator = DataCollatorForLanguageModeling(pad_token_id=0, return_position_ids=True)
    batch = collator([{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]}, {"input_ids": [6], "seq_lengths": [1]}])
    assert list(batch) == ["input_ids", "labels", "position_ids", "attention_mask"]
    assert batch["labels"].tolist() == [[1, 2, 3, 4, 5], [6, -100, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 0, 0, 0, 0]]


def test_collator_padded_layout():
    collator = DataCollatorForLanguageModeling(pad_token_id=0, pad_to_multiple_of=4, return_position_ids=True)
    batch = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, 5]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3, -100], [-100, 5, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]


def test_padding_free_losses_equal_unpadded_per_sequence(model_path, tokenizer):
    """Per-sequence losses in a packed padding-free batch equal those of each sequence run alone."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa").eval()
    texts = ["The sky is blue today.", "One plus one is two, and two plus two is four.", "Hello there!"]
    sequences = [tokenizer(t + tokenizer.eos_token)["input_ids"] for t in texts]
    collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True)
    batch = collator([{"input_ids": s} for s in sequences])
    with torch.no_grad():
        # use_cache=False as in training: transformers only detects packed sequences when no cache is built
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    token_loss = F.cross_entropy(logits[0, :-1].float(), batch["labels"][0, 1:].clamp(min=0), reduction="none") * (
        batch["labels"][0, 1:] != -100
    )
    start = 0
    for seq in sequences:
        n = len(seq)
        packed = token_loss[start : start + n - 1].sum() / (n - 1)
        with torch.no_grad():
            alone_logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits
        alone = F.cross_entropy(alone_logits[0, :-1].float(), torch.tensor(seq[1:]))
        torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)
        start += n


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_packing_strategies_train(tmp_path, model_path, strategy):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    trainer = SFTTrainer(
        model=model_path,
        args=make_args(tmp_path, packing=True, packing_strategy=strategy, max_length=32),
        train_dataset=dataset,
    )
    rows = trainer.train_dataset
    assert all(len(ids) <= 32 for ids in rows["input_ids"])
    if strategy == "wrapped":
        assert not trainer.padding_free
    else:
        assert trainer.padding_free
        assert all(sum(lengths) == len(ids) for lengths, ids in zip(rows["seq_lengths"], rows["input_ids"]))
    before = snapshot(trainer.model)
    trainer.train()
    assert_params_changed(before, trainer.model)


def test_padding_free_without_packing_needs_max_length_none(tmp_path, model_path):
    # As in TRL: padding-free batches without packing do not truncate, so a max_length is refused.
    dataset = load_test_dataset("standard_prompt_completion", split="train")
    with pytest.raises(ValueError, match="`max_length` is not enforced"):
        SFTTrainer(model=model_path, args=make_args(tmp_path, padding_free=True), train_dataset=dataset)


def test_padding_free_without_packing_trains(tmp_path, model_path):
    dataset = load_test_dataset("standard_prompt_completion", split="train")
    trainer = SFTTrainer(
        model=model_path, args=make_args(tmp_path, padding_free=True, max_length=None), train_dataset=dataset
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    assert batch["input_ids"].shape[0] == 1 and "position_ids" in batch
    trainer.train()


# ---------------------------------------------------------------------------------------------------------------------
# Gradient accumulation invariance and resuming
# ---------------------------------------------------------------------------------------------------------------------
def _one_sgd_step(tmp_path, model_path, batch_size, accumulation):
    # Rows of very different lengths so per-batch token counts differ.
    rows = [" ".join(["word"] * (1 + 3 * i)) for i in range(8)]
    dataset = Dataset.from_dict({"text": rows})
    args = make_args(
        tmp_path,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        seed=7,
        **SGD_STEP_ARGS,
    )
    return sgd_step_update(SFTTrainer(model=model_path, args=args, train_dataset=dataset))


def test_gradient_accumulation_invariance(tmp_path, model_path):
    full = _one_sgd_step(tmp_path / "a", model_path, batch_size=8, accumulation=1)
    accumulated = _one_sgd_step(tmp_path / "b", model_path, batch_size=4, accumulation=2)
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], atol=1e-5, rtol=1e-4, msg=name)


def test_save_reload_and_resume(tmp_path, model_path):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, seed=3, data_seed=3)
    full = SFTTrainer(model=model_path, args=make_args(tmp_path / "full", **common), train_dataset=dataset)
    full.train()
    full_losses = [log["loss"] for log in full.state.log_history if "loss" in log]

    # the checkpoint has a model card and reloads as a plain model
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (tmp_path / "full" / "README.md").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert reloaded.config.architectures == ["Qwen2ForCausalLM"]

    resumed = SFTTrainer(model=model_path, args=make_args(tmp_path / "full", **common), train_dataset=dataset)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed_losses = [log["loss"] for log in resumed.state.log_history if "loss" in log]
    assert len(resumed_losses) == 6
    for a, b in zip(resumed_losses[3:], full_losses[3:]):
        assert abs(a - b) < 1e-5

    final = tmp_path / "final"
    resumed.save_model(str(final))
    model = AutoModelForCausalLM.from_pretrained(final)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, dict(resumed.model.named_parameters())[name].detach())
    assert AutoTokenizer.from_pretrained(final).eos_token == "<|im_end|>"


# ---------------------------------------------------------------------------------------------------------------------
# Models: PEFT, MoE, activation offloading, liger
# ---------------------------------------------------------------------------------------------------------------------
def test_peft_lora_trains_only_adapters(tmp_path, model_path):
    from peft import LoraConfig, PeftModel

    dataset = load_test_dataset("standard_prompt_completion", split="train")
    trainer = SFTTrainer(
        model=model_path,
        args=make_args(tmp_path, gradient_checkpointing=True),
        train_dataset=dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert isinstance(trainer.model, PeftModel)
    before = snapshot(trainer.model)
    trainer.train()
    changed = assert_params_changed(before, trainer.model, only_trainable=False)
    assert all("lora_" in name for name in changed)
    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


def test_peft_model_and_peft_config_conflict(tmp_path, model_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_path), LoraConfig(target_modules=["q_proj"]))
    dataset = load_test_dataset("standard_language_modeling", split="train")
    with pytest.raises(ValueError, match="PeftModel"):
        SFTTrainer(model=model, args=make_args(tmp_path), train_dataset=dataset, peft_config=LoraConfig())


def test_moe_router_aux_loss(tmp_path):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    trainer = SFTTrainer(
        model=get_model_path("tiny-Qwen2MoeForCausalLM"),
        args=make_args(tmp_path, router_aux_loss_coef=0.01, max_steps=2),
        train_dataset=dataset,
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert "aux_loss" in logs[-1] and logs[-1]["aux_loss"] > 0


def test_router_aux_loss_on_dense_model_is_an_error(tmp_path, model_path):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    with pytest.raises(ValueError, match="router"):
        SFTTrainer(model=model_path, args=make_args(tmp_path, router_aux_loss_coef=0.01), train_dataset=dataset)


def test_activation_offloading_on_cpu(tmp_path, model_path):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path, activation_offloading=True), train_dataset=dataset)
    before = snapshot(trainer.model)
    trainer.train()
    assert_params_changed(before, trainer.model)


def test_liger_kernel_missing_is_a_clear_error(tmp_path, model_path):
    from trl.import_utils import is_liger_kernel_available

    if is_liger_kernel_available():
        pytest.skip("liger-kernel is installed; this checks the error raised when it is missing")
    dataset = load_test_dataset("standard_language_modeling", split="train")
    with pytest.raises(ImportError, match="liger"):
        SFTTrainer(model=model_path, args=make_args(tmp_path, use_liger_kernel=True), train_dataset=dataset)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: clear errors before training
# ---------------------------------------------------------------------------------------------------------------------
def test_missing_text_column(tmp_path, model_path):
    dataset = Dataset.from_dict({"content": ["a", "b"]})
    with pytest.raises(ValueError, match=r"'text'.*columns \['content'\]|columns \['content'\].*'text'"):
        SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)


def test_completion_only_loss_on_language_modeling_data(tmp_path, model_path):
    # As in TRL: language-modeling data has no completion mask, so completion_only_loss=True trains on every token.
    dataset = load_test_dataset("standard_language_modeling", split="train")
    trainer = SFTTrainer(
        model=model_path, args=make_args(tmp_path, completion_only_loss=True, max_steps=1), train_dataset=dataset
    )
    reference = SFTTrainer(model=model_path, args=make_args(tmp_path, max_steps=1), train_dataset=dataset)
    assert trainer.train_dataset["labels"] == trainer.train_dataset["input_ids"]
    assert trainer.train_dataset["labels"] == reference.train_dataset["labels"]
    trainer.train()
    assert trainer.state.global_step == 1


def test_max_length_shorter_than_every_prompt(tmp_path, model_path):
    dataset = Dataset.from_dict(
        {"prompt": ["A long prompt with many words in it", "Another long prompt here"], "completion": [" a", " b"]}
    )
    with pytest.raises(ValueError, match="max_length=3"):
        SFTTrainer(model=model_path, args=make_args(tmp_path, max_length=3), train_dataset=dataset)


def test_empty_dataset(tmp_path, model_path):
    dataset = Dataset.from_dict({"text": []})
    with pytest.raises(ValueError, match="empty"):
        SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)


def test_no_train_dataset(tmp_path, model_path):
    with pytest.raises(ValueError, match="train_dataset"):
        SFTTrainer(model=model_path, args=make_args(tmp_path))


def test_formatting_func_with_completion_only_loss(tmp_path, model_path):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    with pytest.raises(ValueError, match="formatting function was provided while `completion_only_loss=True`"):
        SFTTrainer(
            model=model_path,
            args=make_args(tmp_path, completion_only_loss=True),
            train_dataset=dataset,
            formatting_func=lambda ex: ex["text"],
        )


def test_sharegpt_roles_kept_as_given(tmp_path, model_path):
    # As in TRL: ShareGPT `conversations` become `messages` with the roles unchanged (no role validation); the chat
    # template renders them.
    dataset = Dataset.from_dict(
        {"conversations": [[{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]], "id": [7]}
    )
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    assert trainer.train_dataset.column_names == ["id", "messages", "input_ids", "labels"]
    assert [m["role"] for m in trainer.train_dataset[0]["messages"]] == ["human", "gpt"]
    text = trainer.processing_class.decode(trainer.train_dataset[0]["input_ids"])
    assert "human\nHi" in text and "gpt\nHello" in text


def test_conversational_data_without_chat_template(tmp_path, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = None
    dataset = load_test_dataset("conversational_language_modeling", split="train")
    with pytest.raises(ValueError, match="chat template"):
        SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset, processing_class=tokenizer)


def test_bad_dtype_string(tmp_path, model_path):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    with pytest.raises(ValueError, match="dtype"):
        SFTTrainer(
            model=model_path,
            args=make_args(tmp_path, model_init_kwargs={"dtype": "float64x"}),
            train_dataset=dataset,
        )


def test_config_deprecations():
    with pytest.warns(FutureWarning, match="bfd_split"):
        config = SFTConfig("out", packing_strategy="bfd-requeue")
    assert config.packing_strategy == "bfd_split"
    with pytest.warns(FutureWarning, match="nll"):
        config = SFTConfig("out", loss_type="chunked_nll")
    assert config.loss_type == "nll"
    assert SFTConfig("out", pad_to_multiple_of="none").pad_to_multiple_of is None
    assert SFTConfig("out", pad_to_multiple_of="64").pad_to_multiple_of == 64
    defaults = SFTConfig("out")
    assert (defaults.learning_rate, defaults.max_length, defaults.logging_steps) == (2e-5, 1024, 10)
    assert defaults.gradient_checkpointing is True and defaults.packing_strategy == "bfd"
    assert json.loads(json.dumps(defaults.to_dict()))["dataset_text_field"] == "text"


# ---------------------------------------------------------------------------------------------------------------------
# TRL 1.16 semantics: prepared columns, pre-tokenized masks, skip_prepare_dataset, evaluate() on raw data, PEFT prompts
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config_name, config, columns",
    [
        ("standard_language_modeling", {}, ["text", "input_ids", "labels"]),
        ("conversational_language_modeling", {}, ["messages", "input_ids", "labels"]),
        ("standard_prompt_completion", {}, ["prompt", "completion", "input_ids", "labels"]),
        (
            "standard_prompt_completion",
            {"completion_only_loss": False},
            ["prompt", "completion", "input_ids", "completion_mask", "labels"],
        ),
        ("standard_language_modeling", {"packing": True, "max_length": 64}, ["input_ids", "labels", "seq_lengths"]),
        (
            "standard_language_modeling",
            {"packing": True, "packing_strategy": "wrapped", "max_length": 32},
            ["input_ids", "labels"],
        ),
    ],
)
def test_prepared_columns_as_trl(tmp_path, model_path, config_name, config, columns):
    dataset = load_test_dataset(config_name)
    args = make_args(tmp_path, **config)
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=dataset["train"], eval_dataset=dataset["test"])
    assert trainer.train_dataset.column_names == columns
    assert trainer.eval_dataset.column_names == columns


def test_raw_columns_carry_the_eos_token(tmp_path, model_path, tokenizer):
    eos = tokenizer.eos_token
    lm = load_test_dataset("standard_language_modeling", split="train")
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=lm)
    assert trainer.train_dataset[0]["text"] == lm[0]["text"] + eos
    pc = load_test_dataset("standard_prompt_completion", split="train")
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=pc)
    row = trainer.train_dataset[0]
    assert (row["prompt"], row["completion"]) == (pc[0]["prompt"], pc[0]["completion"] + eos)
    assert row["input_ids"][-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("remove_unused_columns", [True, False])
def test_only_token_columns_reach_the_model(tmp_path, model_path, remove_unused_columns):
    dataset = load_test_dataset("standard_prompt_completion", split="train")
    dataset = dataset.add_column("id", list(range(len(dataset))))
    args = make_args(tmp_path, max_steps=1, remove_unused_columns=remove_unused_columns, completion_only_loss=False)
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=dataset)
    assert trainer.train_dataset.column_names == [
        "prompt",
        "completion",
        "id",
        "input_ids",
        "completion_mask",
        "labels",
    ]
    seen = []
    handle = trainer.model.register_forward_pre_hook(lambda m, a, kw: seen.append(sorted(kw)), with_kwargs=True)
    trainer.train()
    handle.remove()
    # (A padded batch reaches the model packed: `position_ids` instead of `attention_mask`.)
    assert seen and set(seen[0]) <= {"input_ids", "attention_mask", "position_ids", "logits_to_keep", "use_cache"}


def _pretokenized(tokenizer, prompt_columns=False):
    """Prompt-completion rows tokenized by hand, with a `completion_mask` (prompt 0, completion 1)."""
    rows = load_test_dataset("standard_prompt_completion", split="train").select(range(4))

    def tokenize(example):
        prompt = tokenizer(example["prompt"])["input_ids"]
        full = tokenizer(example["prompt"] + example["completion"])["input_ids"]
        return {"input_ids": full, "completion_mask": [0] * len(prompt) + [1] * (len(full) - len(prompt))}

    return rows.map(tokenize, remove_columns=[] if prompt_columns else ["prompt", "completion"])


def _masked(ids, mask):
    return [i if keep else -100 for i, keep in zip(ids, mask)]


def test_pretokenized_completion_mask(tmp_path, model_path, tokenizer):
    data = _pretokenized(tokenizer)
    ids, mask = data[0]["input_ids"], data[0]["completion_mask"]
    # completion_only_loss=None: pre-tokenized data without prompt/completion columns trains on every token and
    # keeps its mask column (TRL)
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=data)
    assert trainer.train_dataset.column_names == ["input_ids", "completion_mask", "labels"]
    assert trainer.train_dataset[0]["labels"] == ids
    # completion_only_loss=True: the mask is applied and consumed
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path, completion_only_loss=True), train_dataset=data)
    assert trainer.train_dataset.column_names == ["input_ids", "labels"]
    assert trainer.train_dataset[0]["labels"] == _masked(ids, mask)
    # with prompt/completion columns, None means completion-only
    data = _pretokenized(tokenizer, prompt_columns=True)
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path, max_steps=1), train_dataset=data)
    assert trainer.train_dataset.column_names == ["prompt", "completion", "input_ids", "labels"]
    assert trainer.train_dataset[0]["labels"] == _masked(ids, mask)
    trainer.train()


def test_pretokenized_assistant_masks_are_honoured(tmp_path, model_path, tokenizer):
    data = _pretokenized(tokenizer).rename_column("completion_mask", "assistant_masks")
    ids, mask = data[0]["input_ids"], data[0]["assistant_masks"]
    for completion_only_loss in (None, False):
        args = make_args(tmp_path, max_steps=1, completion_only_loss=completion_only_loss)
        trainer = SFTTrainer(model=model_path, args=args, train_dataset=data)
        assert trainer.train_dataset.column_names == ["input_ids", "labels"]
        assert trainer.train_dataset[0]["labels"] == _masked(ids, mask)
    trainer.train()
    # assistant_only_loss=True needs conversational data, pre-tokenized or not (TRL)
    with pytest.raises(ValueError, match="not conversational"):
        SFTTrainer(model=model_path, args=make_args(tmp_path, assistant_only_loss=True), train_dataset=data)


def test_user_labels_are_kept(tmp_path, model_path, tokenizer):
    data = _pretokenized(tokenizer).map(lambda ex: {"labels": [-100, -100] + ex["input_ids"][2:]})
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path, completion_only_loss=True), train_dataset=data)
    assert trainer.train_dataset.column_names == ["input_ids", "completion_mask", "labels"]
    assert trainer.train_dataset["labels"] == data["labels"]


def test_skip_prepare_dataset_without_input_ids_fails_before_training(tmp_path, model_path, tokenizer):
    raw = load_test_dataset("standard_language_modeling", split="train")
    args = make_args(tmp_path, dataset_kwargs={"skip_prepare_dataset": True})
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=raw, eval_dataset=raw)
    assert trainer.train_dataset.column_names == ["text"]  # used as given
    with pytest.raises(ValueError, match="no `input_ids` column"):
        trainer.train()
    assert trainer.state.global_step == 0
    with pytest.raises(ValueError, match="skip_prepare_dataset"):
        trainer.evaluate()
    # tokenized data trains as given: the collator builds the labels
    tokenized = raw.map(lambda ex: {"input_ids": tokenizer(ex["text"])["input_ids"]}, remove_columns=["text"])
    args = make_args(tmp_path, max_steps=1, dataset_kwargs={"skip_prepare_dataset": True})
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=tokenized)
    assert trainer.train_dataset.column_names == ["input_ids"]
    trainer.train()
    assert trainer.state.global_step == 1


def test_evaluate_raw_dataset_and_dict(tmp_path, model_path):
    dataset = load_test_dataset("standard_prompt_completion")
    test = dataset["test"].select(range(4))
    trainer = SFTTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset["train"], eval_dataset=test)
    prepared = trainer.evaluate()
    raw = trainer.evaluate(eval_dataset=test)
    assert raw["eval_loss"] == pytest.approx(prepared["eval_loss"], rel=1e-6)
    assert raw["eval_mean_token_accuracy"] == pytest.approx(prepared["eval_mean_token_accuracy"])
    # an already prepared dataset is left alone
    again = trainer.evaluate(eval_dataset=trainer.eval_dataset)
    assert again["eval_loss"] == pytest.approx(prepared["eval_loss"], rel=1e-6)
    both = trainer.evaluate(eval_dataset={"first": test.select(range(2)), "second": test.select(range(2, 4))})
    assert {"eval_first_loss", "eval_second_loss"} <= set(both)
    streamed = trainer.evaluate(eval_dataset=test.to_iterable_dataset())
    assert streamed["eval_loss"] == pytest.approx(prepared["eval_loss"], rel=1e-6)


def test_bfd_packing_is_one_padding_free_row(tmp_path, model_path):
    dataset = load_test_dataset("standard_language_modeling", split="train")
    args = make_args(tmp_path, max_steps=1, packing=True, max_length=64, per_device_train_batch_size=2)
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=dataset)
    rows = [trainer.train_dataset[i] for i in range(2)]
    batch = trainer.data_collator(rows)
    n_tokens = sum(len(row["input_ids"]) for row in rows)
    assert batch["input_ids"].shape == (1, n_tokens)  # TRL's layout: no padding, whatever the attention kernel
    assert batch["cu_seq_lens_q"][-1].item() == n_tokens
    trainer.train()
    # num_tokens counts the tokens of the batch, and FLOPs follow the same count
    first_batch = next(iter(trainer.get_train_dataloader()))
    assert trainer.state.log_history[0]["num_tokens"] == first_batch["input_ids"].numel()


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning"])
def test_peft_prompt_learning_trains(tmp_path, model_path, kind):
    from peft import PrefixTuningConfig, PromptTuningConfig, TaskType

    cls = PromptTuningConfig if kind == "prompt_tuning" else PrefixTuningConfig
    peft_config = cls(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    dataset = load_test_dataset("standard_language_modeling")
    args = make_args(tmp_path, max_steps=2, gradient_checkpointing=True)
    if kind == "prefix_tuning":
        with pytest.warns(UserWarning, match="gradient checkpointing"):
            trainer = SFTTrainer(model=model_path, args=args, train_dataset=dataset["train"], peft_config=peft_config)
        assert not trainer.args.gradient_checkpointing  # the prefix lives in the cache, which checkpointing drops
    else:
        trainer = SFTTrainer(model=model_path, args=args, train_dataset=dataset["train"], peft_config=peft_config)
    before = snapshot(trainer.model)
    trainer.train()
    changed = assert_params_changed(before, trainer.model)
    assert all("prompt_encoder" in name for name in changed)
    # evaluation averages over the batch's targets; with prompt tuning the last virtual token also predicts the first
    # real token, exactly as the PEFT model's own loss counts it
    test = dataset["test"].select(range(2))
    metrics = trainer.evaluate(eval_dataset=test)
    batch = trainer.data_collator([trainer._prepare_eval_dataset(test, "eval")[i] for i in range(2)])
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(**batch).loss.item()
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-5)

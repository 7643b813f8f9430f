"""PRMTrainer (experimental): stepwise tokenization, loss, step accuracy, PEFT, saving/resuming and bad input."""

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from trainer_utils import SGD_STEP_ARGS, args_builder, sgd_step_update, snapshot
from transformers import AutoModelForTokenClassification, AutoTokenizer, EvalPrediction

from trl.assets import get_model_path, load_test_dataset
from trl.experimental.prm import PRMConfig, PRMTrainer, compute_accuracy


MODEL = "tiny-Qwen2ForTokenClassification"

# Worked example. Token ids (both tiny tokenizers): "Add 2 and 3." -> 9 ids, "Two plus three" -> 8 ids,
# "is five" -> 3 ids, "\n" -> [198]; the Llama tokenizer also has BOS 4080, the Qwen one has no BOS.
EXAMPLE = {"prompt": "Add 2 and 3.", "completions": ["Two plus three", "is five"], "labels": [True, False]}
PROMPT_IDS = [32, 67, 67, 220, 17, 319, 220, 18, 13]
STEP1_IDS = [51, 86, 78, 575, 307, 587, 265, 68]
STEP2_IDS = [259, 646, 608]


@pytest.fixture(scope="module")
def model_path():
    """Overrides the conftest fixture (and so the `tokenizer` fixture): this module trains the token-classification model."""
    return get_model_path(MODEL)


make_args = args_builder(
    PRMConfig, max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=1e-3
)


def tokenize(tokenizer, example=EXAMPLE, separator="\n", max_length=None, max_completion_length=None, **kwargs):
    options = dict(train_on_last_step_only=False, is_eval=False)
    options.update(kwargs)
    return PRMTrainer.tokenize_row(example, tokenizer, separator, max_length, max_completion_length, **options)


# ---------------------------------------------------------------------------------------------------------------------
# Tokenization: labels exactly on the separator after each step
# ---------------------------------------------------------------------------------------------------------------------
def test_tokenize_row_worked_example(tokenizer):
    row = tokenize(tokenizer)
    assert row["input_ids"] == PROMPT_IDS + STEP1_IDS + [198] + STEP2_IDS + [198]
    assert row["labels"] == [-100] * 9 + [-100] * 8 + [1] + [-100] * 3 + [0]
    # the labels sit exactly on the separator tokens
    positions = [i for i, label in enumerate(row["labels"]) if label != -100]
    assert positions == [17, 21] and all(row["input_ids"][i] == 198 for i in positions)


def test_tokenize_row_prepends_bos():
    llama = AutoTokenizer.from_pretrained(get_model_path("tiny-LlamaForTokenClassification"))
    row = tokenize(llama)
    assert row["input_ids"] == [4080] + PROMPT_IDS + STEP1_IDS + [198] + STEP2_IDS + [198]
    assert row["labels"] == [-100] * 10 + [-100] * 8 + [1] + [-100] * 3 + [0]


def test_tokenize_row_multi_token_separator(tokenizer):
    row = tokenize(tokenizer, separator=" ||")  # " ||" -> [220, 91, 91]; the label goes on its last token
    assert row["input_ids"] == PROMPT_IDS + STEP1_IDS + [220, 91, 91] + STEP2_IDS + [220, 91, 91]
    assert row["labels"] == [-100] * 17 + [-100, -100, 1] + [-100] * 3 + [-100, -100, 0]


def test_train_on_last_step_only(tokenizer):
    train_row = tokenize(tokenizer, train_on_last_step_only=True)
    assert train_row["labels"] == [-100] * 21 + [0]
    eval_row = tokenize(tokenizer, train_on_last_step_only=True, is_eval=True)
    assert eval_row["labels"] == [-100] * 17 + [1] + [-100] * 3 + [0]  # evaluation keeps every step


def test_truncation(tokenizer):
    row = tokenize(tokenizer, max_completion_length=10)
    assert row["input_ids"] == PROMPT_IDS + STEP1_IDS + [198, 259]
    assert row["labels"] == [-100] * 17 + [1, -100]
    row = tokenize(tokenizer, max_length=12)
    assert row["input_ids"] == PROMPT_IDS + STEP1_IDS[:3] and row["labels"] == [-100] * 12
    row = tokenize(tokenizer, max_length=20, max_completion_length=9)  # steps first, then the whole sequence
    assert row["input_ids"] == PROMPT_IDS + STEP1_IDS + [198] and row["labels"][-1] == 1


def test_float_labels_are_soft_targets(tokenizer):
    row = tokenize(tokenizer, example={**EXAMPLE, "labels": [0.75, 0.0]})
    assert row["labels"][17] == 0.75 and row["labels"][21] == 0.0


def test_step_containing_the_separator_is_plain_text(tmp_path, model_path, tokenizer, caplog):
    """As in the reference behaviour, no error: the inner separator gets no label; the appended one does."""
    example = {"prompt": "Add 2 and 3.", "completions": ["a\nb", "Done"], "labels": [False, True]}
    row = tokenize(tokenizer, example=example)
    assert row["input_ids"] == PROMPT_IDS + [64, 198, 65, 198] + [35, 597, 198]
    assert row["labels"] == [-100] * 9 + [-100, -100, -100, 0] + [-100, -100, 1]
    with caplog.at_level(logging.WARNING, logger="trl.experimental.prm.prm_trainer"):
        trainer = PRMTrainer(model=model_path, args=make_args(tmp_path), train_dataset=Dataset.from_list([example]))
    assert trainer.train_dataset[0]["labels"] == row["labels"]
    assert any("containing the step separator" in record.getMessage() for record in caplog.records)


def test_trainer_dataset_keeps_integer_labels(tmp_path, model_path, tokenizer):
    """The bool `labels` input column must not turn the new token labels into bools."""
    trainer = PRMTrainer(model=model_path, args=make_args(tmp_path), train_dataset=Dataset.from_list([EXAMPLE]))
    assert trainer.train_dataset.column_names == ["input_ids", "labels"]
    assert trainer.train_dataset[0] == tokenize(tokenizer)
    with_last_only = PRMTrainer(
        model=model_path,
        args=make_args(tmp_path, train_on_last_step_only=True),
        train_dataset=Dataset.from_list([EXAMPLE]),
        eval_dataset=Dataset.from_list([EXAMPLE]),
    )
    assert with_last_only.train_dataset[0]["labels"].count(-100) == 21
    assert with_last_only.eval_dataset[0]["labels"].count(-100) == 20


# ---------------------------------------------------------------------------------------------------------------------
# Training, loss and metrics
# ---------------------------------------------------------------------------------------------------------------------
def test_train_and_evaluate(tmp_path, model_path):
    dataset = load_test_dataset("standard_stepwise_supervision")
    args = make_args(tmp_path, eval_strategy="steps", eval_steps=3)
    trainer = PRMTrainer(model=model_path, args=args, train_dataset=dataset["train"], eval_dataset=dataset["test"])
    before = snapshot(trainer.model)
    trainer.train()
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    # as TRL 1.12: training logs the loss, no step accuracy or token count
    assert len(train_logs) == 3 and not any({"accuracy", "num_tokens"} & set(log) for log in train_logs)
    eval_logs = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert 0.0 <= eval_logs[-1]["eval_accuracy"] <= 1.0


def test_evaluate_prepares_a_raw_dataset(tmp_path, model_path):
    """`evaluate(eval_dataset=...)` tokenizes a raw dataset (or each of a dict, an IterableDataset) exactly as the
    constructor's `eval_dataset`; an already tokenized one is left as it is."""
    from datasets import IterableDataset

    test = load_test_dataset("standard_stepwise_supervision", split="test").select(range(4))
    args = make_args(tmp_path, train_on_last_step_only=True)
    trainer = PRMTrainer(model=model_path, args=args, train_dataset=test, eval_dataset=test)
    assert trainer._prepare_eval_dataset(trainer.eval_dataset, "eval") is trainer.eval_dataset
    prepared = trainer.evaluate()
    raw = trainer.evaluate(eval_dataset=test)
    for key in ("eval_loss", "eval_accuracy"):
        assert raw[key] == pytest.approx(prepared[key], abs=1e-6), key
    stream = trainer.evaluate(eval_dataset=IterableDataset.from_generator(lambda: iter(test)))
    assert stream["eval_loss"] == pytest.approx(prepared["eval_loss"], abs=1e-6)
    both = trainer.evaluate(eval_dataset={"first": test.select(range(2)), "second": test.select(range(2, 4))})
    assert {"eval_first_loss", "eval_second_loss", "eval_first_accuracy", "eval_second_accuracy"} <= set(both)
    # evaluation rows keep every step's label even with train_on_last_step_only (is_eval=True), as in the constructor
    labelled = [sum(label != -100 for label in row["labels"]) for row in trainer.eval_dataset]
    assert labelled == [len(row["labels"]) for row in test]


def _manual_step_ce(model, batch, soft=False):
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    total, count = 0.0, 0
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            label = batch["labels"][b, t].item()
            if label == -100:
                continue
            logp = torch.log_softmax(logits[b, t], dim=-1)
            total += -(label * logp[1] + (1 - label) * logp[0]).item() if soft else -logp[int(label)].item()
            count += 1
    return total / count


def test_loss_matches_hand_written_formula(tmp_path, model_path):
    dataset = load_test_dataset("standard_stepwise_supervision", split="train").select(range(4))
    trainer = PRMTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    trainer.model.eval()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["labels"].dtype == torch.long
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(_manual_step_ce(trainer.model, batch), abs=1e-5)


def test_soft_labels_loss(tmp_path, model_path):
    rows = [
        {"prompt": "Add 2 and 3.", "completions": ["Two plus three", "is five"], "labels": [0.9, 0.25]},
        {"prompt": "Count.", "completions": ["one", "two", "three"], "labels": [1.0, 0.5, 0.0]},
    ]
    trainer = PRMTrainer(
        model=model_path, args=make_args(tmp_path, max_steps=1), train_dataset=Dataset.from_list(rows)
    )
    trainer.model.eval()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert batch["labels"].dtype == torch.float32
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(_manual_step_ce(trainer.model, batch, soft=True), abs=1e-5)
    trainer.model.train()
    trainer.train()


def test_compute_accuracy():
    logits = np.array([[[2.0, 0.0], [0.0, 1.0], [0.0, 3.0]], [[1.0, 0.0], [0.0, 2.0], [-100.0, -100.0]]])
    labels = np.array([[-100, 1, 0], [0, 1, -100]])
    assert compute_accuracy(EvalPrediction(predictions=logits, label_ids=labels)) == {"accuracy": 0.75}
    soft = np.array([[-100, 0.8, 0.3], [0.1, 0.6, -100]])
    assert compute_accuracy(EvalPrediction(predictions=logits, label_ids=soft)) == {"accuracy": 0.75}


def test_gradient_accumulation_invariance(tmp_path, model_path):
    dataset = load_test_dataset("standard_stepwise_supervision", split="train").select(range(8))

    def one_step(out, batch_size, accumulation):
        args = make_args(
            out, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation, **SGD_STEP_ARGS
        )
        return sgd_step_update(PRMTrainer(model=model_path, args=args, train_dataset=dataset))

    full = one_step(tmp_path / "a", 8, 1)
    accumulated = one_step(tmp_path / "b", 4, 2)
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], atol=1e-6, rtol=1e-4, msg=name)


# ---------------------------------------------------------------------------------------------------------------------
# Models, config, files
# ---------------------------------------------------------------------------------------------------------------------
def test_defaults_and_model_instance(tmp_path, model_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = AutoModelForTokenClassification.from_pretrained(model_path)
    dataset = load_test_dataset("standard_stepwise_supervision", split="train").select(range(4))
    trainer = PRMTrainer(model=model, train_dataset=dataset)
    args = trainer.args
    assert args.output_dir.endswith(f"{MODEL}-PRM")
    assert (args.learning_rate, args.max_length, args.max_completion_length) == (1e-5, 1024, None)
    assert (args.step_separator, args.train_on_last_step_only, args.disable_dropout) == ("\n", False, True)
    assert (args.gradient_checkpointing, args.logging_steps, args.dataset_num_proc) == (True, 10, None)
    args.max_steps, args.report_to = 1, []
    trainer.train()
    assert trainer.state.global_step == 1


def test_model_init(tmp_path, model_path, tokenizer):
    dataset = load_test_dataset("standard_stepwise_supervision", split="train")
    trainer = PRMTrainer(
        model_init=lambda: AutoModelForTokenClassification.from_pretrained(model_path),
        args=make_args(tmp_path, max_steps=1),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    with pytest.raises(ValueError, match="processing_class"):
        PRMTrainer(model_init=lambda: None, args=make_args(tmp_path), train_dataset=dataset)


def test_peft_trains_the_classification_head(tmp_path, model_path):
    from peft import LoraConfig, PeftModel

    dataset = load_test_dataset("standard_stepwise_supervision", split="train")
    trainer = PRMTrainer(
        model=model_path,
        args=make_args(tmp_path),
        train_dataset=dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert isinstance(trainer.model, PeftModel)
    before = snapshot(trainer.model)
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert any("score" in n for n in changed) and any("lora_" in n for n in changed)
    trainer.save_model(str(tmp_path / "adapter"))
    base = AutoModelForTokenClassification.from_pretrained(model_path)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    trainer.model.eval()
    ids = torch.tensor([trainer.train_dataset[0]["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)


def test_save_reload_and_resume(tmp_path, model_path):
    dataset = load_test_dataset("standard_stepwise_supervision", split="train")
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, seed=5, data_seed=5)
    full = PRMTrainer(model=model_path, args=make_args(tmp_path / "run", **common), train_dataset=dataset)
    full.train()
    full_losses = [log["loss"] for log in full.state.log_history if "loss" in log]
    card = (tmp_path / "run" / "README.md").read_text()
    assert "PRM" in card and "2211.14275" in card

    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert AutoModelForTokenClassification.from_pretrained(checkpoint).config.num_labels == 2
    resumed = PRMTrainer(model=model_path, args=make_args(tmp_path / "run", **common), train_dataset=dataset)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed_losses = [log["loss"] for log in resumed.state.log_history if "loss" in log]
    assert len(resumed_losses) == 4
    for a, b in zip(resumed_losses[2:], full_losses[2:]):
        assert abs(a - b) < 1e-5


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: clear errors before training
# ---------------------------------------------------------------------------------------------------------------------
def test_labels_length_differs_from_steps(tmp_path, model_path):
    dataset = Dataset.from_list([{"prompt": "Q", "completions": ["a", "b", "c"], "labels": [True, False]}])
    with pytest.raises(ValueError, match="3 steps and 2 labels"):
        PRMTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)


def test_conversational_dataset_is_rejected(tmp_path, model_path):
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "Q"}], "completions": ["a"], "labels": [True]}]
    )
    with pytest.raises(ValueError, match="standard"):
        PRMTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)


def test_missing_columns(tmp_path, model_path):
    dataset = load_test_dataset("standard_preference", split="train")
    with pytest.raises(ValueError, match=r"missing \['completions', 'labels'\]"):
        PRMTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)


@pytest.mark.parametrize("labels", [[2, 0], [1.5, 0.0]])
def test_bad_label_values(tmp_path, model_path, labels):
    dataset = Dataset.from_list([{"prompt": "Q", "completions": ["a", "b"], "labels": labels}])
    with pytest.raises(ValueError, match="Step labels must be bools"):
        PRMTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)


def test_other_bad_inputs(tmp_path, model_path):
    dataset = load_test_dataset("standard_stepwise_supervision", split="train")
    with pytest.raises(ValueError, match="model_init"):
        PRMTrainer(args=make_args(tmp_path), train_dataset=dataset)
    with pytest.raises(ValueError, match="train_dataset"):
        PRMTrainer(model=model_path, args=make_args(tmp_path))
    with pytest.raises(ValueError, match="step_separator"):
        PRMConfig("out", step_separator="")
    with pytest.raises(ValueError, match="labelled step left"):
        PRMTrainer(model=model_path, args=make_args(tmp_path, max_length=2), train_dataset=dataset)


def test_soft_labels_need_two_classes(tmp_path, model_path):
    model = AutoModelForTokenClassification.from_pretrained(model_path, num_labels=3, ignore_mismatched_sizes=True)
    rows = [{"prompt": "Q", "completions": ["a", "b"], "labels": [0.5, 0.25]}]
    with pytest.raises(ValueError, match="num_labels=3"):
        PRMTrainer(model=model, args=make_args(tmp_path), train_dataset=Dataset.from_list(rows))


def test_loss_equals_cross_entropy_with_ignore_index(tmp_path, model_path):
    """Integer labels reproduce F.cross_entropy(ignore_index=-100) exactly."""
    dataset = load_test_dataset("standard_stepwise_supervision", split="train").select(range(3))
    trainer = PRMTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    trainer.model.eval()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, expected)

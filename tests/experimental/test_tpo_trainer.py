"""Experimental TPOTrainer: the preference term against hand-written formulas, the batch loss and metrics against a
full-logits oracle, the triple collator, training on every dataset shape, checkpoints, PEFT and bad inputs."""

import math

import pytest
import torch
from datasets import Dataset
from trainer_utils import (
    PREFERENCE_ARGS,
    args_builder,
    assert_saved_model_reloads,
    padded_completion_logps,
    read_model_card,
    resume_from_first_checkpoint,
    train_and_check_metrics,
    train_logs,
    train_peft_adapters_only,
)

from trl.assets import load_test_dataset
from trl.experimental.tpo import TPOConfig, TPOTrainer
from trl.experimental.tpo.tpo_trainer import DataCollatorForTriplePreference, tpo_loss


pytestmark = pytest.mark.usefixtures("single_thread")

METRICS = [
    "entropy",
    "num_tokens",
    "logits/chosen",
    "logits/rejected",
    "mean_token_accuracy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
]
DATASET_SHAPES = [
    "standard_preference",
    "conversational_preference",
    "standard_implicit_prompt_preference",
    "conversational_implicit_prompt_preference",
]

make_args = args_builder(TPOConfig, **PREFERENCE_ARGS)


def with_reference(example):
    chosen = example["chosen"]
    if isinstance(chosen, str):
        return {"reference": chosen + " indeed"}
    return {"reference": [*chosen[:-1], {**chosen[-1], "content": chosen[-1]["content"] + " indeed"}]}


def triples(name, split, n=8):
    return load_test_dataset(name, split=split).select(range(n)).map(with_reference)


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------
def test_config_defaults_match_contract():
    args = TPOConfig("out")
    assert args.learning_rate == 5e-7 and args.model_init_kwargs is None and args.trust_remote_code is False
    assert args.disable_dropout is True and args.dataset_num_proc is None
    assert (args.max_length, args.truncation_mode, args.pad_to_multiple_of) == (1024, "keep_start", None)
    assert (args.loss_type, args.beta, args.label_smoothing) == ("sigmoid", 0.01, 0.0)
    assert (args.tpo_alpha, args.tpo_l_gamma) == (1.0, 0.5)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"loss_type": "robust"}, "loss_type must be one of"),
        ({"truncation_mode": "middle"}, "truncation_mode"),
        ({"loss_type": "ipo", "beta": 0.0}, "divides by beta"),
        ({"max_length": 1}, "max_length must be at least 2"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
    ],
)
def test_config_rejects_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        TPOConfig("out", **overrides)


# ---------------------------------------------------------------------------------------------------------------------
# Preference term against hand-written scalar code
# ---------------------------------------------------------------------------------------------------------------------
CHOSEN = [-5.0, -8.0, -3.5]
REJECTED = [-6.0, -7.0, -9.0]


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def hand_loss(loss_type, chosen, rejected, beta, label_smoothing=0.0, gamma=0.5):
    delta = chosen - rejected
    if loss_type in ("sigmoid", "tpo-l"):
        logit = beta * delta - (gamma if loss_type == "tpo-l" else 0.0)
        return -(1 - label_smoothing) * log_sigmoid(logit) - label_smoothing * log_sigmoid(-logit)
    if loss_type == "hinge":
        return max(0.0, 1 - beta * delta)
    if loss_type == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    raise AssertionError(loss_type)


@pytest.mark.parametrize(
    "loss_type, beta, label_smoothing, gamma",
    [
        ("sigmoid", 0.1, 0.0, 0.5),
        ("sigmoid", 0.5, 0.2, 0.5),
        ("hinge", 0.3, 0.0, 0.5),
        ("ipo", 0.2, 0.0, 0.5),
        ("tpo-l", 2.0, 0.0, 0.5),
        ("tpo-l", 2.0, 0.1, 1.2),
    ],
)
def test_tpo_loss_matches_hand_formula(loss_type, beta, label_smoothing, gamma):
    losses, chosen_rewards, rejected_rewards = tpo_loss(
        torch.tensor(CHOSEN, dtype=torch.float64),
        torch.tensor(REJECTED, dtype=torch.float64),
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        tpo_l_gamma=gamma,
    )
    for i, (c, r) in enumerate(zip(CHOSEN, REJECTED)):
        assert losses[i].item() == pytest.approx(hand_loss(loss_type, c, r, beta, label_smoothing, gamma))
        assert chosen_rewards[i].item() == pytest.approx(beta * c)
        assert rejected_rewards[i].item() == pytest.approx(beta * r)


# ---------------------------------------------------------------------------------------------------------------------
# Collator
# ---------------------------------------------------------------------------------------------------------------------
EXAMPLE = {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5], "reference_ids": [6, 7, 8]}


def test_collator_rows_and_masks():
    batch = DataCollatorForTriplePreference(pad_token_id=0)([EXAMPLE])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0], [1, 2, 4, 5, 0], [1, 2, 6, 7, 8]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    without = DataCollatorForTriplePreference(pad_token_id=0, include_reference=False)([EXAMPLE])
    assert without["input_ids"].tolist() == [[1, 2, 3, 0], [1, 2, 4, 5]]


def test_collator_truncation_and_padding_multiple():
    keep_end = DataCollatorForTriplePreference(pad_token_id=0, max_length=3, truncation_mode="keep_end")([EXAMPLE])
    assert keep_end["input_ids"].tolist() == [[1, 2, 3], [2, 4, 5], [6, 7, 8]]
    assert keep_end["completion_mask"].tolist() == [[0, 0, 1], [0, 1, 1], [1, 1, 1]]
    padded = DataCollatorForTriplePreference(pad_token_id=9, max_length=3, pad_to_multiple_of=4)([EXAMPLE])
    assert padded["input_ids"].tolist() == [[1, 2, 3, 9], [1, 2, 4, 9], [1, 2, 6, 9]]


# ---------------------------------------------------------------------------------------------------------------------
# The batch loss and metrics against an independent full-logits computation
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"loss_type": "hinge", "beta": 0.3},
        {"loss_type": "ipo", "beta": 0.5, "tpo_alpha": 0.4},
        {"loss_type": "tpo-l", "beta": 2.0, "label_smoothing": 0.1},
        {"tpo_alpha": 0.0},
    ],
)
def test_batch_loss_and_metrics_match_full_logits_oracle(tmp_path, model_path, overrides):
    trainer = TPOTrainer(
        model_path, args=make_args(tmp_path, **overrides), train_dataset=triples("standard_preference", "train")
    )
    args = trainer.args
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["input_ids"].shape[0] == (12 if args.tpo_alpha else 8)
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    token_logps, mask, logits = padded_completion_logps(trainer.model, batch)
    sums, counts = (token_logps * mask).sum(1), mask.sum(1)
    seq = sums / counts if args.loss_type in ("ipo", "tpo-l") else sums
    chosen, rejected = seq[:4], seq[4:8]
    hand = [
        hand_loss(args.loss_type, c, r, args.beta, args.label_smoothing, args.tpo_l_gamma)
        for c, r in zip(chosen.tolist(), rejected.tolist())
    ]
    expected = sum(hand) / 4
    if args.tpo_alpha:
        expected += args.tpo_alpha * (-(token_logps[8:] * mask[8:]).sum() / mask[8:].sum()).item()
    assert loss.item() == pytest.approx(expected, rel=1e-5)

    metrics = {key: values[-1] for key, values in trainer._metrics["eval"].items()}
    assert sorted(metrics) == sorted(METRICS)
    probs = logits.softmax(-1)
    entropy = -(probs * logits.log_softmax(-1)).sum(-1)
    assert metrics["entropy"] == pytest.approx(((entropy * mask).sum() / mask.sum()).item(), rel=1e-5)
    mean_logit = logits.mean(-1)
    assert metrics["logits/chosen"] == pytest.approx(
        ((mean_logit[:4] * mask[:4]).sum() / mask[:4].sum()).item(), abs=1e-6
    )
    correct = (logits[:4].argmax(-1) == batch["input_ids"][:4, 1:]).float()
    assert metrics["mean_token_accuracy"] == pytest.approx(((correct * mask[:4]).sum() / mask[:4].sum()).item())
    assert metrics["logps/chosen"] == pytest.approx(chosen.mean().item(), rel=1e-5)
    assert metrics["rewards/margins"] == pytest.approx(args.beta * (chosen - rejected).mean().item(), rel=1e-4)
    assert metrics["num_tokens"] == 0.0  # evaluation logs the training tokens seen so far


# ---------------------------------------------------------------------------------------------------------------------
# Datasets and training
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dataset_name", DATASET_SHAPES)
def test_train_changes_params_and_logs_every_metric(tmp_path, model_path, dataset_name):
    trainer = TPOTrainer(
        model_path,
        args=make_args(tmp_path),
        train_dataset=triples(dataset_name, "train"),
        eval_dataset=triples(dataset_name, "test", 4),
    )
    evaluation = train_and_check_metrics(trainer, METRICS)
    assert evaluation["eval_num_tokens"] == train_logs(trainer)[-1]["num_tokens"]
    assert trainer.ref_model is None


def test_tokenization_keeps_text_columns_and_splits_at_shared_prompt(tmp_path, model_path, tokenizer):
    train = Dataset.from_dict(
        {"prompt": ["The sky is"], "chosen": [" blue"], "rejected": [" green"], "reference": [" blue today"]}
    )
    trainer = TPOTrainer(model_path, args=make_args(tmp_path), train_dataset=train)
    row = trainer.train_dataset[0]
    eos = tokenizer.eos_token
    assert row["prompt_ids"] == tokenizer("The sky is")["input_ids"]
    assert row["chosen_ids"] == tokenizer(" blue" + eos)["input_ids"]
    assert row["reference_ids"] == tokenizer(" blue today" + eos)["input_ids"]
    assert row["reference"] == " blue today" + eos


def test_implicit_prompt_is_removed_from_the_reference(tmp_path, model_path):
    train = Dataset.from_dict(
        {"chosen": ["The sky is blue"], "rejected": ["The sky is green"], "reference": ["The sky is blue today"]}
    )
    row = TPOTrainer(model_path, args=make_args(tmp_path), train_dataset=train).train_dataset[0]
    assert row["prompt"] == "The sky is" and row["reference"].startswith(" blue today")


def test_pretokenized_dataset_trains(tmp_path, model_path):
    data = Dataset.from_dict(
        {"prompt_ids": [[5, 6]] * 4, "chosen_ids": [[7]] * 4, "rejected_ids": [[8, 9]] * 4, "reference_ids": [[7]] * 4}
    )
    trainer = TPOTrainer(model_path, args=make_args(tmp_path), train_dataset=data, eval_dataset=data)
    assert trainer.train_dataset.column_names == ["prompt_ids", "chosen_ids", "rejected_ids", "reference_ids"]
    train_and_check_metrics(trainer, METRICS)


def test_evaluate_prepares_a_raw_dataset(tmp_path, model_path):
    trainer = TPOTrainer(model_path, args=make_args(tmp_path), train_dataset=triples("standard_preference", "train"))
    metrics = trainer.evaluate(triples("standard_preference", "test", 4))
    assert "eval_loss" in metrics and "eval_rewards/margins" in metrics


def test_save_reload_model_card_and_resume(tmp_path, model_path):
    train = triples("standard_preference", "train")
    trainer = TPOTrainer(model_path, args=make_args(tmp_path), train_dataset=train)
    trainer.train()
    assert_saved_model_reloads(trainer, tmp_path / "saved")
    trainer.create_model_card()
    card = read_model_card(tmp_path)
    assert "TPO" in card and "2405.16681" in card
    args = make_args(tmp_path / "resume", save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(TPOTrainer, args, tmp_path / "resume", model=model_path, train_dataset=train)


def test_peft_trains_adapters_only(tmp_path, model_path):
    train_peft_adapters_only(
        TPOTrainer, model=model_path, args=make_args(tmp_path), train_dataset=triples("standard_preference", "train")
    )


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs, refused before training
# ---------------------------------------------------------------------------------------------------------------------
def test_missing_reference_column_is_refused(tmp_path, model_path):
    data = load_test_dataset("standard_preference", split="train").select(range(4))
    with pytest.raises(ValueError, match="'reference' \\(gold\\) column"):
        TPOTrainer(model_path, args=make_args(tmp_path), train_dataset=data)


def test_missing_chosen_column_is_refused(tmp_path, model_path):
    data = triples("standard_preference", "train", 4).remove_columns("chosen")
    with pytest.raises(ValueError, match="missing 'chosen' or 'rejected'"):
        TPOTrainer(model_path, args=make_args(tmp_path), train_dataset=data)


def test_reference_without_the_implicit_prompt_is_refused(tmp_path, model_path):
    data = Dataset.from_dict({"chosen": ["a b x"], "rejected": ["a b z"], "reference": ["q"]})
    with pytest.raises(ValueError, match="does not start with the implicit prompt"):
        TPOTrainer(model_path, args=make_args(tmp_path), train_dataset=data)


def test_non_tokenizer_processing_class_is_refused(tmp_path, model_path):
    with pytest.raises(TypeError, match="needs a tokenizer"):
        TPOTrainer(
            model_path,
            args=make_args(tmp_path),
            train_dataset=triples("standard_preference", "train", 4),
            processing_class=object(),
        )


def test_label_smoothing_ignored_by_hinge_warns(tmp_path, model_path):
    with pytest.warns(UserWarning, match="does not use label smoothing"):
        TPOTrainer(
            model_path,
            args=make_args(tmp_path, loss_type="hinge", label_smoothing=0.1),
            train_dataset=triples("standard_preference", "train", 4),
        )

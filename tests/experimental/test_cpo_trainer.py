"""Experimental CPOTrainer (CPO, SimPO, AlphaPO): loss formulas, the batch loss against a full-logits oracle, every
dataset shape, no reference model, checkpoints, PEFT and bad inputs."""

import math

import pytest
import torch
from datasets import Dataset
from trainer_utils import (
    PREFERENCE_ARGS,
    args_builder,
    assert_saved_model_reloads,
    changed_params,
    encoder_decoder_pair_logps,
    read_model_card,
    resume_from_first_checkpoint,
    snapshot,
    train_and_check_metrics,
    train_peft_adapters_only,
)
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from trl.assets import get_model_path, load_test_dataset
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.cpo.cpo_trainer import alphapo_shaped_logps, cpo_loss


pytestmark = pytest.mark.usefixtures("single_thread")

METRICS = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/rejected",
    "logps/chosen",
    "logits/rejected",
    "logits/chosen",
    "nll_loss",
]
DATASET_SHAPES = [
    "standard_preference",
    "conversational_preference",
    "standard_implicit_prompt_preference",
    "conversational_implicit_prompt_preference",
]

make_args = args_builder(CPOConfig, **PREFERENCE_ARGS)


def small(name, split, n=8):
    return load_test_dataset(name, split=split).select(range(n))


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------
def test_config_defaults_match_contract():
    args = CPOConfig("out")
    assert args.learning_rate == 1e-6 and (args.max_length, args.max_completion_length) == (1024, None)
    assert (args.beta, args.label_smoothing, args.loss_type) == (0.1, 0.0, "sigmoid")
    assert (args.cpo_alpha, args.simpo_gamma, args.alpha) == (1.0, 0.5, 0.0)
    assert args.disable_dropout is True and args.generate_during_eval is False and args.is_encoder_decoder is None
    assert args.model_init_kwargs is None and args.trust_remote_code is False and args.dataset_num_proc is None
    assert args.logging_steps == 10 and args.gradient_checkpointing is True


def test_alphapo_is_stored_as_simpo_without_nll():
    args = CPOConfig("out", loss_type="alphapo", alpha=0.25)
    assert (args.loss_type, args.cpo_alpha, args.alpha) == ("simpo", 0.0, 0.25)
    with pytest.warns(UserWarning, match="cpo_alpha=0.5 is replaced by 0"):
        assert CPOConfig("out", loss_type="alphapo", cpo_alpha=0.5).cpo_alpha == 0.0


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"loss_type": "robust"}, "Unknown loss type: robust. Should be one of"),
        ({"label_smoothing": 0.7}, r"label_smoothing .* \[0, 0.5\]"),
        ({"beta": 0.0, "loss_type": "simpo"}, "beta must not be 0 with loss_type='simpo'"),
        ({"max_length": 1}, "max_length must be at least 2"),
    ],
)
def test_config_rejects_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        CPOConfig("out", **overrides)


def test_beta_zero_without_division_warns_and_is_kept():
    # TRL trains the sigmoid and hinge losses with beta=0 (only the NLL term learns): a warning, not an error.
    with pytest.warns(UserWarning, match="switches the preference term off"):
        assert CPOConfig("out", beta=0.0).beta == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# Loss formulas against hand-written scalar code
# ---------------------------------------------------------------------------------------------------------------------
CHOSEN = [-5.0, -8.0, -3.5]
REJECTED = [-6.0, -7.0, -9.0]


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def shaped(logp, alpha):
    return logp if alpha == 0 else (1 - math.exp(-alpha * logp)) / alpha


def hand_loss(loss_type, chosen, rejected, beta, label_smoothing=0.0, gamma=0.5, alpha=0.0):
    delta = shaped(chosen, alpha) - shaped(rejected, alpha)
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * log_sigmoid(beta * delta) - label_smoothing * log_sigmoid(-beta * delta)
    if loss_type == "simpo":
        margin = beta * delta - gamma
        return -(1 - label_smoothing) * log_sigmoid(margin) - label_smoothing * log_sigmoid(-margin)
    if loss_type == "hinge":
        return max(0.0, 1 - beta * delta)
    if loss_type == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    raise AssertionError(loss_type)


@pytest.mark.parametrize(
    "loss_type, beta, label_smoothing, gamma, alpha",
    [
        ("sigmoid", 0.1, 0.0, 0.5, 0.0),
        ("sigmoid", 0.5, 0.2, 0.5, 0.0),
        ("hinge", 0.3, 0.0, 0.5, 0.0),
        ("ipo", 0.2, 0.0, 0.5, 0.0),
        ("simpo", 2.0, 0.0, 0.5, 0.0),
        ("simpo", 2.0, 0.1, 1.2, 0.0),
        ("simpo", 2.0, 0.0, 0.5, 0.25),  # AlphaPO
        ("simpo", 1.5, 0.05, 0.3, -0.4),  # AlphaPO, negative alpha
        ("sigmoid", 0.1, 0.0, 0.5, 0.1),  # the shape applies to every loss type
    ],
)
def test_cpo_loss_matches_hand_formula(loss_type, beta, label_smoothing, gamma, alpha):
    losses, chosen_rewards, rejected_rewards = cpo_loss(
        torch.tensor(CHOSEN, dtype=torch.float64),
        torch.tensor(REJECTED, dtype=torch.float64),
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=gamma,
        alpha=alpha,
    )
    for i, (c, r) in enumerate(zip(CHOSEN, REJECTED)):
        assert losses[i].item() == pytest.approx(hand_loss(loss_type, c, r, beta, label_smoothing, gamma, alpha))
        assert chosen_rewards[i].item() == pytest.approx(beta * shaped(c, alpha))
        assert rejected_rewards[i].item() == pytest.approx(beta * shaped(r, alpha))


def test_alphapo_shape_tends_to_the_log_probability():
    logps = torch.tensor(CHOSEN, dtype=torch.float64)
    assert torch.equal(alphapo_shaped_logps(logps, 0.0), logps)
    assert torch.allclose(alphapo_shaped_logps(logps, 1e-7), logps, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# The batch loss and metrics against an independent full-logits computation
# ---------------------------------------------------------------------------------------------------------------------
def oracle(model, rows, pad_id, average):
    """Sequence log-probs, chosen NLL and mean logits (over every padded position) from TRL's dataset columns."""
    seqs = [row[f"{k}_input_ids"] for k in ("chosen", "rejected") for row in rows]
    labels = [row[f"{k}_labels"] for k in ("chosen", "rejected") for row in rows]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lab = torch.tensor([list(x) + [-100] * (width - len(x)) for x in labels])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    targets = lab[:, 1:]
    scored = targets != -100
    token_logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    sums = (token_logps * scored).sum(1)
    logps = sums / scored.sum(1) if average else sums
    n = len(rows)
    nll = torch.nn.functional.cross_entropy(logits[:n, :-1].reshape(-1, logits.shape[-1]), targets[:n].reshape(-1))
    return logps[:n], logps[n:], nll, logits[:n].mean(), logits[n:].mean()


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_type": "sigmoid", "cpo_alpha": 0.7, "label_smoothing": 0.1},
        {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0},  # pure SimPO: no NLL term (logged as 0)
        {"loss_type": "alphapo", "alpha": 0.3, "beta": 2.0},
        {"loss_type": "ipo", "beta": 0.5},
        {"loss_type": "hinge"},
    ],
)
def test_batch_loss_and_metrics_match_full_logits_oracle(tmp_path, model_path, overrides):
    train = small("standard_preference", "train")
    trainer = CPOTrainer(model_path, args=make_args(tmp_path, **overrides), train_dataset=train)
    args = trainer.args
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(rows)
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    average = args.loss_type in ("ipo", "simpo")
    chosen, rejected, nll, logits_chosen, logits_rejected = oracle(trainer.model, rows, trainer.pad_token_id, average)
    hand = [
        hand_loss(args.loss_type, c, r, args.beta, args.label_smoothing, args.simpo_gamma, args.alpha)
        for c, r in zip(chosen.tolist(), rejected.tolist())
    ]
    expected = sum(hand) / len(hand) + args.cpo_alpha * nll.item()
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    metrics = {key: values[-1] for key, values in trainer._metrics["eval"].items()}
    assert list(metrics) == METRICS
    assert metrics["logps/chosen"] == pytest.approx(chosen.mean().item(), rel=1e-5)
    assert metrics["rewards/margins"] == pytest.approx(
        args.beta
        * (alphapo_shaped_logps(chosen, args.alpha) - alphapo_shaped_logps(rejected, args.alpha)).mean().item(),
        rel=1e-4,
        abs=1e-6,
    )
    assert metrics["nll_loss"] == pytest.approx(nll.item() if args.cpo_alpha else 0.0, rel=1e-5)
    assert metrics["logits/chosen"] == pytest.approx(logits_chosen.item(), abs=1e-7)
    assert metrics["logits/rejected"] == pytest.approx(logits_rejected.item(), abs=1e-7)


# ---------------------------------------------------------------------------------------------------------------------
# Training on every dataset shape, evaluation, no reference model
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dataset_name", DATASET_SHAPES)
def test_train_changes_params_and_logs_every_metric(tmp_path, model_path, dataset_name):
    train, test = small(dataset_name, "train"), small(dataset_name, "test", 4)
    trainer = CPOTrainer(
        model_path, args=make_args(tmp_path, loss_type="simpo"), train_dataset=train, eval_dataset=test
    )
    train_and_check_metrics(trainer, METRICS)


def test_pretokenized_datasets_train(tmp_path, model_path, tokenizer):
    prompt = tokenizer("The sky is")["input_ids"]
    chosen, rejected = tokenizer(" blue.")["input_ids"], tokenizer(" green.")["input_ids"]
    dpo_style = Dataset.from_dict(
        {"prompt_ids": [prompt] * 4, "chosen_ids": [chosen] * 4, "rejected_ids": [rejected] * 4}
    )
    trainer = CPOTrainer(model_path, args=make_args(tmp_path), train_dataset=dpo_style)
    row = trainer.train_dataset[0]
    assert row["chosen_input_ids"] == prompt + chosen and row["chosen_labels"] == [-100] * len(prompt) + chosen
    # TRL's own columns (prompt included in chosen/rejected) are accepted as they are
    trl_style = trainer.train_dataset.select_columns(["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"])
    again = CPOTrainer(model_path, args=make_args(tmp_path), train_dataset=trl_style)
    assert again.train_dataset[0]["rejected_input_ids"] == prompt + rejected
    before = snapshot(again.model)
    again.train()
    assert changed_params(before, again.model)


def test_no_reference_model_is_created(tmp_path, model_path):
    trainer = CPOTrainer(model_path, args=make_args(tmp_path), train_dataset=small("standard_preference", "train"))
    assert trainer.ref_model is None
    policy_params = sum(p.numel() for p in trainer.model.parameters())
    held = {
        id(p) for value in vars(trainer).values() if isinstance(value, torch.nn.Module) for p in value.parameters()
    }
    assert sum(p.numel() for p in trainer.model.parameters() if id(p) in held) == policy_params
    assert len(held) == len(list(trainer.model.parameters()))


def test_tokenization_and_truncation(tmp_path, model_path, tokenizer, caplog):
    train = Dataset.from_dict({"prompt": ["The sky is", "one two three four five six"], "chosen": [" blue"] * 2})
    train = train.add_column("rejected", [" green", " red"])
    prompt_len = len(tokenizer("The sky is")["input_ids"])
    trainer = CPOTrainer(model_path, args=make_args(tmp_path, max_length=prompt_len + 1), train_dataset=train)
    row = trainer.train_dataset[0]
    # the prompt is kept whole, the completion cut to the room left; the EOS token ends uncut completions
    assert len(row["chosen_input_ids"]) == prompt_len + 1 and row["chosen_labels"][:prompt_len] == [-100] * prompt_len
    full = CPOTrainer(model_path, args=make_args(tmp_path, max_length=None), train_dataset=train)
    assert full.train_dataset[0]["chosen_input_ids"][-1] == tokenizer.eos_token_id
    assert len(trainer.train_dataset) == 1  # the second prompt fills max_length: dropped with a warning
    assert "Dropping 1 of 2 train pairs" in caplog.text


def test_compute_metrics_and_evaluate_raw_dataset(tmp_path, model_path):
    """As in TRL, `compute_metrics` gets two predictions per evaluation batch, its mean chosen and rejected logits
    (the `eval_logits/*` metrics), with labels 0.0; `ignore_keys` leaves one out."""
    test = small("standard_preference", "test", 4)
    seen = []
    trainer = CPOTrainer(
        model_path,
        args=make_args(tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4),
        train_dataset=small("standard_preference", "train"),
        eval_dataset=test,
        compute_metrics=lambda prediction: seen.append(prediction) or {"test": float(prediction.predictions.size)},
    )
    trainer.train()
    evals = [log for log in trainer.state.log_history if "eval_test" in log]
    assert evals and evals[-1]["eval_test"] == 2.0
    metrics = trainer.evaluate()
    predictions, labels = seen[-1].predictions, seen[-1].label_ids
    assert predictions.tolist() == pytest.approx([metrics["eval_logits/chosen"], metrics["eval_logits/rejected"]])
    assert labels.tolist() == [0.0, 0.0]
    only_rejected = trainer.predict(test, ignore_keys=["eval_logits/chosen"])
    assert only_rejected.predictions.tolist() == pytest.approx([metrics["eval_logits/rejected"]])
    raw = trainer.evaluate(eval_dataset=test)
    assert raw["eval_loss"] == pytest.approx(metrics["eval_loss"])


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints and PEFT
# ---------------------------------------------------------------------------------------------------------------------
def test_save_reload_and_model_card(tmp_path, model_path):
    trainer = CPOTrainer(model_path, args=make_args(tmp_path), train_dataset=small("standard_preference", "train"))
    trainer.train()
    assert_saved_model_reloads(trainer, tmp_path / "saved")
    trainer.create_model_card()
    assert "CPO" in read_model_card(tmp_path) and "2401.08417" in read_model_card(tmp_path)


def test_resume_from_checkpoint(tmp_path, model_path):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1, loss_type="simpo", seed=0)
    resume_from_first_checkpoint(
        CPOTrainer, args, tmp_path, model=model_path, train_dataset=small("standard_preference", "train")
    )


def test_peft_trains_adapters_only(tmp_path, model_path):
    pytest.importorskip("peft")
    train_peft_adapters_only(
        CPOTrainer, model=model_path, args=make_args(tmp_path), train_dataset=small("standard_preference", "train")
    )


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs fail before training
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data, match",
    [
        ({"prompt": ["a"], "rejected": [" x"]}, r"missing: \['chosen'\]"),
        ({"prompt": ["a"], "completion": [" x"], "label": [True]}, "unpaired data"),
        ({"text": ["a b c"]}, r"has columns \['text'\]"),
    ],
)
def test_non_preference_data_fails_before_training(tmp_path, model_path, data, match):
    with pytest.raises(ValueError, match=match):
        CPOTrainer(model_path, args=make_args(tmp_path), train_dataset=Dataset.from_dict(data))


def test_wrong_args_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="train_dataset"):
        CPOTrainer(get_model_path("tiny-Qwen2ForCausalLM"), args=make_args(tmp_path))


# ---------------------------------------------------------------------------------------------------------------------
# Encoder-decoder models (tiny T5): prompt to the encoder, completions as decoder labels
# ---------------------------------------------------------------------------------------------------------------------
T5 = "tiny-T5ForConditionalGeneration"


def t5_args(tmp_path, **overrides):
    return make_args(tmp_path, **{"max_completion_length": 16, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_type": "sigmoid", "cpo_alpha": 0.7, "label_smoothing": 0.1},
        {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0},
        {"loss_type": "alphapo", "alpha": 0.3, "beta": 2.0},
    ],
)
def test_encoder_decoder_loss_matches_full_logits_oracle(tmp_path, overrides):
    trainer = CPOTrainer(
        get_model_path(T5), args=t5_args(tmp_path, **overrides), train_dataset=small("standard_preference", "train")
    )
    assert trainer.is_encoder_decoder and type(trainer.model).__name__ == "T5ForConditionalGeneration"
    args = trainer.args
    rows = [trainer.train_dataset[i] for i in range(4)]
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(rows))
    token_logps, mask, logits = encoder_decoder_pair_logps(trainer.model, rows)
    sums = token_logps.sum(1)
    logps = sums / mask.sum(1) if args.loss_type in ("ipo", "simpo") else sums
    chosen, rejected = logps[:4], logps[4:]
    nll = -token_logps[:4].sum() / mask[:4].sum()  # the chosen completions' tokens only
    hand = [
        hand_loss(args.loss_type, c, r, args.beta, args.label_smoothing, args.simpo_gamma, args.alpha)
        for c, r in zip(chosen.tolist(), rejected.tolist())
    ]
    assert loss.item() == pytest.approx(sum(hand) / len(hand) + args.cpo_alpha * nll.item(), rel=1e-5)
    metrics = {key: values[-1] for key, values in trainer._metrics["eval"].items()}
    assert list(metrics) == METRICS
    assert metrics["logps/chosen"] == pytest.approx(chosen.mean().item(), rel=1e-5)
    assert metrics["logps/rejected"] == pytest.approx(rejected.mean().item(), rel=1e-5)
    assert metrics["nll_loss"] == pytest.approx(nll.item() if args.cpo_alpha else 0.0, rel=1e-5)
    # logits/* average every decoder position, the label padding included
    assert metrics["logits/chosen"] == pytest.approx(logits[:4].mean().item(), abs=1e-7)
    assert metrics["logits/rejected"] == pytest.approx(logits[4:].mean().item(), abs=1e-7)


@pytest.mark.parametrize("dataset_name", ["standard_preference", "conversational_preference"])
def test_encoder_decoder_trains_logs_every_metric_and_evaluates(tmp_path, dataset_name):
    train, test = small(dataset_name, "train"), small(dataset_name, "test", 4)
    trainer = CPOTrainer(get_model_path(T5), args=t5_args(tmp_path), train_dataset=train, eval_dataset=test)
    assert set(trainer.train_dataset.column_names) >= {"prompt_input_ids", "chosen_labels", "rejected_labels"}
    train_and_check_metrics(trainer, METRICS)
    assert_saved_model_reloads(trainer, tmp_path / "saved", model_class=AutoModelForSeq2SeqLM)


def test_encoder_decoder_tokenization(tmp_path):
    t5 = get_model_path(T5)
    tokenizer = AutoTokenizer.from_pretrained(t5)
    train = Dataset.from_dict({"prompt": ["one two three four five six"], "chosen": [" a b c d"], "rejected": [" x"]})
    trainer = CPOTrainer(t5, args=t5_args(tmp_path, max_completion_length=2, max_length=4), train_dataset=train)
    row = trainer.train_dataset[0]
    # the prompt is kept whole (max_length does not apply), the completions cut to max_completion_length
    assert row["prompt_input_ids"] == tokenizer("one two three four five six")["input_ids"]
    assert row["chosen_labels"] == tokenizer(" a b c d")["input_ids"][:2]
    assert row["rejected_labels"] == tokenizer(" x")["input_ids"]
    with pytest.warns(UserWarning, match="128 tokens are used"):
        CPOTrainer(t5, args=make_args(tmp_path), train_dataset=train)
    pretokenized = Dataset.from_dict({"prompt_ids": [[5, 6, 7]], "chosen_ids": [[8, 9]], "rejected_ids": [[10]]})
    again = CPOTrainer(t5, args=t5_args(tmp_path), train_dataset=pretokenized)
    assert (again.train_dataset[0]["prompt_input_ids"], again.train_dataset[0]["chosen_labels"]) == ([5, 6, 7], [8, 9])
    with pytest.raises(ValueError, match="empty rejected completion"):
        CPOTrainer(t5, args=t5_args(tmp_path), train_dataset=pretokenized.map(lambda _: {"rejected_ids": []}))


def test_encoder_decoder_flag_with_model_init_and_contradictions(tmp_path):
    t5 = get_model_path(T5)
    train = small("standard_preference", "train", 4)
    trainer = CPOTrainer(
        model_init=lambda: AutoModelForSeq2SeqLM.from_pretrained(t5),
        args=t5_args(tmp_path, is_encoder_decoder=True),
        train_dataset=train,
        processing_class=AutoTokenizer.from_pretrained(t5),
    )
    assert trainer.is_encoder_decoder and "chosen_labels" in trainer.train_dataset.column_names
    with pytest.raises(ValueError, match="is an encoder-decoder model"):
        CPOTrainer(t5, args=t5_args(tmp_path, is_encoder_decoder=False), train_dataset=train)
    with pytest.raises(ValueError, match="is a decoder-only model"):
        CPOTrainer(
            model_init=lambda: AutoModelForCausalLM.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM")),
            args=make_args(tmp_path, is_encoder_decoder=True),
            train_dataset=train,
        )


def test_encoder_decoder_generation_returns_prompt_and_completion(tmp_path):
    t5 = get_model_path(T5)
    tokenizer = AutoTokenizer.from_pretrained(t5)
    trainer = CPOTrainer(
        t5, args=t5_args(tmp_path, max_completion_length=4), train_dataset=small("standard_preference", "train", 2)
    )
    rows = [trainer.train_dataset[i] for i in range(2)]
    texts = trainer.generate_from_model(trainer.model, trainer.data_collator(rows))
    for row, text in zip(rows, texts):
        assert text.startswith(tokenizer.decode(row["prompt_input_ids"], skip_special_tokens=True))

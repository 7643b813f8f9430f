"""Experimental ORPOTrainer: the log odds ratio against a hand computation, the batch loss against a full-logits
oracle, every dataset shape, no reference model, checkpoints, PEFT and bad inputs."""

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
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from trl.assets import get_model_path, load_test_dataset
from trl.experimental.orpo import ORPOConfig, ORPOTrainer
from trl.experimental.orpo.orpo_trainer import orpo_log_odds_ratio, orpo_loss


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
    "log_odds_ratio",
    "log_odds_chosen",
]

make_args = args_builder(ORPOConfig, **PREFERENCE_ARGS)


def small(name, split, n=8):
    return load_test_dataset(name, split=split).select(range(n))


def test_config_defaults_match_contract():
    args = ORPOConfig("out")
    assert args.learning_rate == 1e-6 and (args.max_length, args.max_completion_length) == (1024, None)
    assert args.beta == 0.1 and args.padding_value is None and args.disable_dropout is True
    assert args.generate_during_eval is False and args.is_encoder_decoder is None and args.model_init_kwargs is None
    assert args.trust_remote_code is False and args.dataset_num_proc is None
    with pytest.warns(UserWarning, match="beta weighs the odds-ratio term"):  # TRL trains with it: a warning only
        assert ORPOConfig("out", beta=-1.0).beta == -1.0


# ---------------------------------------------------------------------------------------------------------------------
# Log odds ratio against a hand computation
# ---------------------------------------------------------------------------------------------------------------------
def test_log_odds_ratio_and_loss_match_hand_computation():
    chosen, rejected, beta = [-0.4, -1.2, -2.5], [-0.9, -0.8, -3.0], 0.3
    losses, ratio, log_odds, rewards = orpo_loss(
        torch.tensor(chosen, dtype=torch.float64), torch.tensor(rejected, dtype=torch.float64), beta
    )
    for i, (c, r) in enumerate(zip(chosen, rejected)):
        p_c, p_r = math.exp(c), math.exp(r)
        hand_log_odds = math.log((p_c / (1 - p_c)) / (p_r / (1 - p_r)))
        assert log_odds[i].item() == pytest.approx(hand_log_odds)
        hand_ratio = math.log(1 / (1 + math.exp(-hand_log_odds)))
        assert ratio[i].item() == pytest.approx(hand_ratio)
        assert losses[i].item() == pytest.approx(-beta * hand_ratio)
        assert rewards[:, i].tolist() == pytest.approx([beta * c, beta * r])
    assert torch.allclose(orpo_log_odds_ratio(log_odds.new_tensor(chosen), log_odds.new_tensor(chosen)), log_odds * 0)


# ---------------------------------------------------------------------------------------------------------------------
# The batch loss and metrics against an independent full-logits computation
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_batch_loss_and_metrics_match_full_logits_oracle(tmp_path, model_path, beta):
    trainer = ORPOTrainer(
        model_path, args=make_args(tmp_path, beta=beta), train_dataset=small("standard_preference", "train")
    )
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(rows)
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)

    seqs = [row[f"{k}_input_ids"] for k in ("chosen", "rejected") for row in rows]
    labels = [row[f"{k}_labels"] for k in ("chosen", "rejected") for row in rows]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [trainer.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits.float()
    token_logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    completion = torch.tensor([list(x) + [-100] * (width - len(x)) for x in labels])[:, 1:] != -100
    mean_logps = (token_logps * completion).sum(1) / completion.sum(1)
    chosen, rejected = mean_logps[:4], mean_logps[4:]
    # ORPO's NLL covers the whole chosen sequence, prompt included
    real = mask[:4, 1:].bool()
    nll = -(token_logps[:4] * real).sum() / real.sum()
    # logits/* average every position of the padded batch but the last
    check_loss_and_metrics(trainer, loss, chosen, rejected, nll, logits[:, :-1], beta)


def check_loss_and_metrics(trainer, loss, chosen, rejected, nll, logits, beta):
    """The batch loss and eval metrics against the oracle's mean log-probs, NLL and the logits `logits/*` average."""
    p_c, p_r = chosen.exp(), rejected.exp()
    log_odds = torch.log(p_c / (1 - p_c)) - torch.log(p_r / (1 - p_r))
    expected = nll - beta * torch.nn.functional.logsigmoid(log_odds).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    metrics = {key: values[-1] for key, values in trainer._metrics["eval"].items()}
    assert list(metrics) == METRICS
    assert metrics["nll_loss"] == pytest.approx(nll.item(), rel=1e-5)
    assert metrics["log_odds_chosen"] == pytest.approx(log_odds.mean().item(), rel=1e-3, abs=1e-6)
    assert metrics["rewards/chosen"] == pytest.approx(beta * chosen.mean().item(), rel=1e-5)
    assert metrics["rewards/rejected"] == pytest.approx(beta * rejected.mean().item(), rel=1e-5)
    n = len(chosen)
    assert metrics["logits/chosen"] == pytest.approx(logits[:n].mean().item(), abs=1e-7)
    assert metrics["logits/rejected"] == pytest.approx(logits[n:].mean().item(), abs=1e-7)


def test_padding_value_fills_beyond_each_half(tmp_path, model_path):
    trainer = ORPOTrainer(
        model_path,
        args=make_args(tmp_path, padding_value=0),
        train_dataset=small("standard_preference", "train"),
    )
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(rows)
    chosen_longest = max(len(r["chosen_input_ids"]) for r in rows)
    rejected_longest = max(len(r["rejected_input_ids"]) for r in rows)
    width = batch["input_ids"].shape[1]
    assert width == max(chosen_longest, rejected_longest)
    assert (batch["input_ids"][:4, chosen_longest:] == 0).all() and (
        batch["input_ids"][4:, rejected_longest:] == 0
    ).all()
    shortest = min(len(r["chosen_input_ids"]) for r in rows)
    if shortest < chosen_longest:  # within the half, the tokenizer's pad token
        assert trainer.pad_token_id in batch["input_ids"][:4, shortest:chosen_longest]


# ---------------------------------------------------------------------------------------------------------------------
# Training on every dataset shape, no reference model, checkpoints, PEFT
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dataset_name",
    [
        "standard_preference",
        "conversational_preference",
        "standard_implicit_prompt_preference",
        "conversational_implicit_prompt_preference",
    ],
)
def test_train_changes_params_and_logs_every_metric(tmp_path, model_path, dataset_name):
    train, test = small(dataset_name, "train"), small(dataset_name, "test", 4)
    trainer = ORPOTrainer(model_path, args=make_args(tmp_path), train_dataset=train, eval_dataset=test)
    assert trainer.ref_model is None
    train_and_check_metrics(trainer, METRICS)


def test_pretokenized_dataset_trains(tmp_path, model_path, tokenizer):
    prompt = tokenizer("The sky is")["input_ids"]
    data = Dataset.from_dict(
        {
            "prompt_ids": [prompt] * 4,
            "chosen_ids": [tokenizer(" blue.")["input_ids"]] * 4,
            "rejected_ids": [tokenizer(" green.")["input_ids"]] * 4,
        }
    )
    trainer = ORPOTrainer(model_path, args=make_args(tmp_path), train_dataset=data)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)


def test_save_reload_resume_and_model_card(tmp_path, model_path):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1, seed=0)
    trainer, _ = resume_from_first_checkpoint(
        ORPOTrainer, args, tmp_path, model=model_path, train_dataset=small("standard_preference", "train")
    )
    assert_saved_model_reloads(trainer, tmp_path / "saved")
    trainer.create_model_card()
    assert "ORPO" in read_model_card(tmp_path) and "2403.07691" in read_model_card(tmp_path)


def test_peft_trains_adapters_only(tmp_path, model_path):
    pytest.importorskip("peft")
    train_peft_adapters_only(
        ORPOTrainer, model=model_path, args=make_args(tmp_path), train_dataset=small("standard_preference", "train")
    )


def test_bad_inputs_fail_before_training(tmp_path, model_path):
    with pytest.raises(ValueError, match=r"missing: \['chosen'\]"):
        ORPOTrainer(
            model_path, args=make_args(tmp_path), train_dataset=Dataset.from_dict({"prompt": ["a"], "rejected": ["b"]})
        )
    with pytest.raises(TypeError, match="needs args of type ORPOConfig"):
        from trl.experimental.cpo import CPOConfig

        ORPOTrainer(model_path, args=CPOConfig(str(tmp_path)), train_dataset=small("standard_preference", "train"))


# ---------------------------------------------------------------------------------------------------------------------
# Encoder-decoder models (tiny T5): prompt to the encoder, completions as decoder labels
# ---------------------------------------------------------------------------------------------------------------------
T5 = "tiny-T5ForConditionalGeneration"


def test_encoder_decoder_loss_matches_full_logits_oracle(tmp_path):
    beta = 0.5
    trainer = ORPOTrainer(
        get_model_path(T5),
        args=make_args(tmp_path, beta=beta, max_completion_length=16),
        train_dataset=small("standard_preference", "train"),
    )
    assert trainer.is_encoder_decoder
    rows = [trainer.train_dataset[i] for i in range(4)]
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(rows))
    token_logps, mask, logits = encoder_decoder_pair_logps(trainer.model, rows)
    mean_logps = token_logps.sum(1) / mask.sum(1)
    chosen, rejected = mean_logps[:4], mean_logps[4:]
    # the decoder holds no prompt: the NLL covers the chosen completions only; logits/* average every decoder
    # position (the last one included, unlike decoder-only models)
    nll = -token_logps[:4].sum() / mask[:4].sum()
    check_loss_and_metrics(trainer, loss, chosen, rejected, nll, logits, beta)


def test_encoder_decoder_trains_logs_every_metric_and_evaluates(tmp_path):
    t5 = get_model_path(T5)
    train, test = small("conversational_preference", "train"), small("conversational_preference", "test", 4)
    trainer = ORPOTrainer(
        model_init=lambda: AutoModelForSeq2SeqLM.from_pretrained(t5),
        args=make_args(tmp_path, is_encoder_decoder=True, max_completion_length=16, padding_value=0),
        train_dataset=train,
        eval_dataset=test,
        processing_class=AutoTokenizer.from_pretrained(t5),
    )
    train_and_check_metrics(trainer, METRICS)

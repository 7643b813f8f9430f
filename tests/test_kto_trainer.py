"""KTOTrainer: data preparation (unpairing, KL completions), losses, reference handling, metrics, saving, resuming."""

import math
import warnings

import pytest
import torch
from datasets import Dataset, IterableDataset, Value
from trainer_utils import (
    PREFERENCE_ARGS,
    args_builder,
    assert_same_params,
    assert_saved_model_reloads,
    changed_params,
    padded_completion_logps,
    perturb,
    read_model_card,
    snapshot,
)
from transformers import AutoModelForCausalLM

from trl import KTOConfig, KTOTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, kto_kl_reference_point, kto_loss
from trl.trainer.unpaired_preference_base import _KLCompletions, _UnpairedPreferenceTrainer


MODEL = "tiny-Qwen2ForCausalLM"
METRICS = [
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
]


make_args = args_builder(KTOConfig, **PREFERENCE_ARGS)


def oracle_logps(model, batch):
    """Summed completion log-probs with a full log-softmax on the padded batch (the tests' oracle)."""
    token_logps, mask, logits = padded_completion_logps(model, batch)
    return (token_logps * mask).sum(1), logits, mask


def kl_rows(batch):
    """The KL sequences of a collated batch under the plain key names."""
    return {key: batch[f"KL_{key}"] for key in ("input_ids", "attention_mask", "completion_mask")}


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------
def test_config_defaults_match_contract():
    args = KTOConfig("out")
    assert args.learning_rate == 1e-6 and args.train_sampling_strategy == "sequential"
    assert (args.loss_type, args.beta, args.desirable_weight, args.undesirable_weight) == ("kto", 0.1, 1.0, 1.0)
    assert (args.max_length, args.pad_to_multiple_of, args.dataset_num_proc) == (1024, None, None)
    assert (args.precompute_ref_log_probs, args.precompute_ref_batch_size) == (False, None)
    assert (args.sync_ref_model, args.ref_model_mixup_alpha, args.ref_model_sync_steps) == (False, 0.6, 512)
    assert args.disable_dropout is True and args.router_aux_loss_coef is None and args.activation_offloading is False
    assert args.model_init_kwargs is None and args.trust_remote_code is False
    assert args.logging_steps == 10 and args.gradient_checkpointing is True
    assert KTOConfig("out", model_init_kwargs='{"dtype": "float32"}').model_init_kwargs == {"dtype": "float32"}
    with pytest.raises(ValueError, match="loss_type must be one of"):
        KTOConfig("out", loss_type="sigmoid")
    with pytest.warns(UserWarning, match="negative weight turns that part of the loss around"):  # TRL trains with it
        assert KTOConfig("out", undesirable_weight=-1.0).undesirable_weight == -1.0


def test_experimental_aliases_warn(tmp_path):
    from trl.experimental.kto import KTOConfig as OldConfig
    from trl.experimental.kto import KTOTrainer as OldTrainer

    with pytest.warns(FutureWarning, match="use trl.KTOConfig"):
        args = OldConfig(str(tmp_path))
    assert isinstance(args, KTOConfig) and issubclass(OldTrainer, KTOTrainer)


# ---------------------------------------------------------------------------------------------------------------------
# Collator and KL completions
# ---------------------------------------------------------------------------------------------------------------------
def test_collator_pads_main_and_kl_sequences_apart():
    collator = DataCollatorForUnpairedPreference(pad_token_id=0)
    examples = [
        {"prompt_ids": [1, 2], "completion_ids": [3], "label": True, "KL_completion_ids": [7, 8, 9],
         "ref_logps": -1.0, "ref_KL_logps": -5.0},
        {"prompt_ids": [6], "completion_ids": [7, 8, 9], "label": False, "KL_completion_ids": [3],
         "ref_logps": -2.0, "ref_KL_logps": -6.0},
    ]  # fmt: skip
    batch = collator(examples)
    assert list(batch) == ["input_ids", "attention_mask", "completion_mask", "KL_input_ids", "KL_attention_mask",
                           "KL_completion_mask", "ref_logps", "ref_KL_logps", "label"]  # fmt: skip
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [6, 7, 8, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    assert batch["KL_input_ids"].tolist() == [[1, 2, 7, 8, 9], [6, 3, 0, 0, 0]]
    assert batch["KL_attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["KL_completion_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch["label"].tolist() == [True, False]
    assert batch["ref_logps"].tolist() == [-1.0, -2.0] and batch["ref_KL_logps"].tolist() == [-5.0, -6.0]
    # Without KL completions: main rows only; max_length keeps the start; pad_to_multiple_of rounds the width up.
    plain = [{k: v for k, v in ex.items() if k in ("prompt_ids", "completion_ids", "label")} for ex in examples]
    batch = DataCollatorForUnpairedPreference(pad_token_id=0, max_length=3, pad_to_multiple_of=4)(plain)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [6, 7, 8, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 1, 0]]
    assert set(batch) == {"input_ids", "attention_mask", "completion_mask", "label"}


def test_kl_completions_are_the_previous_completion_of_the_chunk():
    batch = {"prompt_ids": [[1], [1], [2], [3]], "completion_ids": [[10], [11], [12], [13]]}
    # Example i gets example i-1's completion (the first one the chunk's last), whatever the prompts.
    assert _KLCompletions()(batch)["KL_completion_ids"] == [[13], [10], [11], [12]]
    assert _KLCompletions()({"prompt_ids": [[1]], "completion_ids": [[10]]})["KL_completion_ids"] == [[10]]


# ---------------------------------------------------------------------------------------------------------------------
# Loss formulas against hand-written ones on fixed log-probs
# ---------------------------------------------------------------------------------------------------------------------
POLICY = [-5.0, -8.0, -3.5, -6.0]
REF = [-5.5, -7.5, -4.0, -5.0]
LABEL = [True, False, True, False]
POLICY_KL = [-9.0, -7.0, -8.5, -6.0]
REF_KL = [-10.0, -7.5, -8.0, -7.3]


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_kl_reference_point_formula():
    t = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    expected = sum(p - r for p, r in zip(POLICY_KL, REF_KL)) / 4  # (1 + 0.5 - 0.5 + 1.3) / 4 = 0.575
    assert kto_kl_reference_point(t(POLICY_KL), t(REF_KL)).item() == pytest.approx(expected, abs=1e-12)
    # A negative estimate is clamped to 0 (KL is never negative).
    assert kto_kl_reference_point(t(REF_KL), t(POLICY_KL)).item() == 0.0
    assert kto_kl_reference_point(t([]), t([])).item() == 0.0


@pytest.mark.parametrize("beta, dw, uw", [(0.1, 1.0, 1.0), (0.5, 1.3, 0.7)])
def test_kto_loss_formula(beta, dw, uw):
    t = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    kl = max(0.0, sum(p - r for p, r in zip(POLICY_KL, REF_KL)) / 4)
    expected = []
    for p, r, label in zip(POLICY, REF, LABEL):
        if label:
            expected.append(dw * (1 - sig(beta * ((p - r) - kl))))
        else:
            expected.append(uw * (1 - sig(beta * (kl - (p - r)))))
    kl_t = kto_kl_reference_point(t(POLICY_KL), t(REF_KL))
    losses = kto_loss(t(POLICY), t(REF), torch.tensor(LABEL), kl_t, beta=beta, desirable_weight=dw,
                      undesirable_weight=uw)  # fmt: skip
    assert torch.allclose(losses, t(expected), rtol=1e-12, atol=1e-12)


def test_apo_zero_unpaired_loss_formula():
    t = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    expected = [
        (1 - sig(0.2 * (p - r))) if label else 0.5 * sig(0.2 * (p - r)) for p, r, label in zip(POLICY, REF, LABEL)
    ]
    losses = kto_loss(t(POLICY), t(REF), torch.tensor(LABEL), kl=123.0, beta=0.2, undesirable_weight=0.5,
                      loss_type="apo_zero_unpaired")  # fmt: skip
    assert torch.allclose(losses, t(expected), rtol=1e-12, atol=1e-12)  # the KL plays no part


# ---------------------------------------------------------------------------------------------------------------------
# The trainer's loss on a real batch, against an independent computation
# ---------------------------------------------------------------------------------------------------------------------
def test_compute_loss_with_kl_term_and_metrics(tmp_path, model_path, unpaired):
    args = make_args(tmp_path, beta=0.3, desirable_weight=1.2, undesirable_weight=0.8)
    trainer = KTOTrainer(model_path, args=args, train_dataset=unpaired["train"].select(range(8)))
    trainer.model.train()
    examples = [trainer.train_dataset[i] for i in range(4)]
    assert all(ex["KL_completion_ids"] != ex["completion_ids"] for ex in examples)
    batch = trainer.data_collator(examples)
    assert batch["input_ids"].shape[0] == 4 and batch["KL_input_ids"].shape[0] == 4

    # Random noise on the reference makes it less likely than the policy on any given text: the KL estimate of the
    # policy to the reference is then positive (not clamped to 0).
    perturb(trainer.model, seed=0, scale=0.02)
    perturb(trainer.ref_model, seed=1, scale=0.1, all_params=True)
    pol, logits, mask = oracle_logps(trainer.model, batch)
    ref, _, _ = oracle_logps(trainer.ref_model, batch)
    pol_kl, _, _ = oracle_logps(trainer.model, kl_rows(batch))
    ref_kl, _, _ = oracle_logps(trainer.ref_model, kl_rows(batch))
    kl = (pol_kl - ref_kl).mean().item()
    assert kl > 0
    label = batch["label"]
    logratio = pol - ref
    chosen = 1.2 * (1 - torch.sigmoid(0.3 * (logratio - kl)))
    rejected = 0.8 * (1 - torch.sigmoid(0.3 * (kl - logratio)))
    expected = torch.where(label, chosen, rejected).mean()

    grads = {}
    for batched in (False, True):  # KL rows in their own no-grad forward, or in the policy's gradient forward
        trainer._kl_in_policy_forward = batched
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, batch)
        assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
        loss.backward()
        grads[batched] = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[False], grads[True]))

    # TRL's metrics of one batch: per-class means over its examples; logits averaged over the class's tokens.
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert not any(key.endswith("_sum") or key.startswith("count/") for key in metrics)
    rewards = 0.3 * logratio
    assert metrics["kl"] == pytest.approx(kl, abs=1e-5)
    assert metrics["rewards/chosen"] == pytest.approx(rewards[label].mean().item(), abs=1e-5)
    assert metrics["rewards/rejected"] == pytest.approx(rewards[~label].mean().item(), abs=1e-5)
    assert metrics["rewards/margins"] == pytest.approx(
        rewards[label].mean().item() - rewards[~label].mean().item(), abs=1e-5
    )
    assert metrics["logps/chosen"] == pytest.approx(pol[label].mean().item(), abs=1e-4)
    assert metrics["logps/rejected"] == pytest.approx(pol[~label].mean().item(), abs=1e-4)
    token_logit = logits.mean(-1)  # (4, T-1): mean over the vocabulary
    for name, rows in (("chosen", label), ("rejected", ~label)):
        expected_logit = token_logit[rows][mask[rows].bool()].mean().item()
        assert metrics[f"logits/{name}"] == pytest.approx(expected_logit, abs=1e-6)
    probs = torch.softmax(logits, -1)
    entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    assert metrics["entropy"] == pytest.approx(entropy[mask.bool()].mean().item(), abs=1e-4)
    assert metrics["num_tokens"] == 2 * batch["attention_mask"].sum().item()  # a running total over 2 calls

    # A batch of one class records nothing for the other class nor a margin; at log time every metric is the mean
    # of its per-batch values.
    chosen_only = trainer.data_collator([ex for ex in examples if ex["label"]])
    trainer.compute_loss(trainer.model, chosen_only)
    chosen_rewards = trainer._metrics["train"]["rewards/chosen"]
    assert len(chosen_rewards) == 3 and len(trainer._metrics["train"]["rewards/rejected"]) == 2
    assert len(trainer._metrics["train"]["rewards/margins"]) == 2
    trainer.log({})
    log = trainer.state.log_history[-1]
    assert log["rewards/chosen"] == pytest.approx(sum(chosen_rewards) / 3, abs=1e-9)
    assert log["rewards/rejected"] == pytest.approx(rewards[~label].mean().item(), abs=1e-5)
    assert log["rewards/margins"] == pytest.approx(metrics["rewards/margins"], abs=1e-9)


def test_moe_aux_loss(tmp_path, unpaired):
    args = make_args(tmp_path, router_aux_loss_coef=0.01, max_steps=1)
    trainer = KTOTrainer(get_model_path("tiny-Qwen2MoeForCausalLM"), args=args, train_dataset=unpaired["train"])
    trainer.train()
    assert trainer.state.log_history[0]["aux_loss"] > 0
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        KTOTrainer(get_model_path(MODEL), args=args, train_dataset=unpaired["train"])


# ---------------------------------------------------------------------------------------------------------------------
# Data preparation
# ---------------------------------------------------------------------------------------------------------------------
def test_paired_data_is_unpaired(tmp_path, model_path, tokenizer):
    paired = load_test_dataset("standard_preference", split="train").select(range(6))
    trainer = KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=paired)
    prepared = trainer.train_dataset
    assert len(prepared) == 12
    # As in TRL: every chosen completion (label True), then every rejected one (False), raw columns kept
    assert prepared["label"] == [True] * 6 + [False] * 6
    assert set(prepared.column_names) == {"prompt", "completion", "label", "prompt_ids", "completion_ids",
                                          "KL_completion_ids"}  # fmt: skip
    for i, row in enumerate(paired):
        for offset, key in ((0, "chosen"), (6, "rejected")):
            ids = prepared[i + offset]
            assert ids["prompt"] == row["prompt"] and ids["completion"].startswith(row[key])
            full = tokenizer(row["prompt"] + row[key] + tokenizer.eos_token)["input_ids"]
            assert ids["prompt_ids"] + ids["completion_ids"] == full
            assert tokenizer.decode(ids["prompt_ids"]) == row["prompt"]
    # The implicit-prompt variant gives the same unpaired data (its prompt is extracted first).
    implicit = load_test_dataset("conversational_implicit_prompt_preference", split="train").select(range(3))
    explicit = load_test_dataset("conversational_preference", split="train").select(range(3))
    a = KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=implicit, processing_class=tokenizer)
    b = KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=explicit, processing_class=tokenizer)
    assert a.train_dataset["prompt_ids"] == b.train_dataset["prompt_ids"]
    assert a.train_dataset["completion_ids"] == b.train_dataset["completion_ids"]


def test_unbalanced_data_warns_with_suggested_weights():
    data = Dataset.from_dict({"label": [True] * 30 + [False] * 10})
    with pytest.warns(UserWarning, match=r"ratio is 3\.000.*undesirable_weight between 2\.250 and 3\.000"):
        _UnpairedPreferenceTrainer._warn_if_unbalanced(data, 1.0, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _UnpairedPreferenceTrainer._warn_if_unbalanced(data, 1.0, 2.5)  # 30 : 25 = 1.2, inside [1, 4/3]
    with pytest.warns(UserWarning, match="only desirable examples"):  # one label only: TRL trains, a warning here
        _UnpairedPreferenceTrainer._warn_if_unbalanced(Dataset.from_dict({"label": [True] * 5}), 1.0, 1.0)
    with pytest.warns(UserWarning, match=r"desirable_weight between 2\.000 and 2\.667"):
        _UnpairedPreferenceTrainer._warn_if_unbalanced(Dataset.from_dict({"label": [True] * 5 + [False] * 10}), 1, 1)


def test_truncation_drops_examples_without_completion(tmp_path, model_path):
    rows = [{"prompt": "word " * 30, "completion": " a", "label": True},
            {"prompt": "1 + 1 =", "completion": " 2", "label": False},
            {"prompt": "2 + 2 =", "completion": " 4", "label": True}]  # fmt: skip
    trainer = KTOTrainer(model_path, args=make_args(tmp_path, max_length=12), train_dataset=Dataset.from_list(rows))
    assert len(trainer.train_dataset) == 2
    assert trainer.data_collator([trainer.train_dataset[0]])["input_ids"].shape[1] <= 12


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config_name", ["standard_unpaired_preference", "conversational_unpaired_preference"])
def test_train_and_evaluate(tmp_path, model_path, config_name):
    dataset = load_test_dataset(config_name)
    args = make_args(tmp_path, eval_strategy="steps", eval_steps=2)
    trainer = KTOTrainer(model_path, args=args, train_dataset=dataset["train"], eval_dataset=dataset["test"])
    before, ref_before = snapshot(trainer.model), snapshot(trainer.ref_model)
    trainer.train()
    assert changed_params(before, trainer.model)
    assert all(torch.equal(ref_before[n], p) for n, p in trainer.ref_model.named_parameters())
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(train_logs) == 2
    assert train_logs[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # policy == reference: 1 - sigmoid(0)
    assert train_logs[0]["kl"] == 0.0
    # A batch without desirable (or undesirable) rows logs no metric of that side, as in TRL; which batch lacks one
    # depends on the sampler's order, so every metric must appear in some step.
    for key in [*METRICS, "num_tokens"]:
        assert any(key in log and math.isfinite(log[key]) for log in train_logs), key
    assert train_logs[-1]["num_tokens"] > train_logs[0]["num_tokens"] > 0
    eval_log = next(log for log in trainer.state.log_history if "eval_loss" in log)
    for key in METRICS:
        assert f"eval_{key}" in eval_log, key


def test_evaluate_prepares_raw_datasets_and_dicts(tmp_path, model_path, unpaired):
    train, test = unpaired["train"].select(range(8)), unpaired["test"].select(range(8))
    trainer = KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=train, eval_dataset=test)
    # TRL's keys, nothing else; at policy == reference the KL estimate is exactly 0 (same passes for both).
    metrics = trainer.evaluate()
    # (`epoch` is there from transformers 5: 4.x's `evaluate` before any training step returns none.)
    assert {k for k in metrics if not k.endswith(("_runtime", "_per_second")) and k != "epoch"} == {
        "eval_loss", "eval_kl", "eval_entropy", "eval_num_tokens", "eval_logits/chosen", "eval_logits/rejected",
        "eval_rewards/chosen", "eval_logps/chosen", "eval_rewards/rejected", "eval_logps/rejected",
        "eval_rewards/margins",
    }  # fmt: skip
    assert metrics["eval_kl"] == 0.0 and metrics["eval_rewards/margins"] == 0.0
    # A raw dataset is prepared like the constructor's eval_dataset; a prepared one is used as it is.
    raw = trainer.evaluate(eval_dataset=test)
    assert raw["eval_loss"] == metrics["eval_loss"] and raw["eval_logps/chosen"] == metrics["eval_logps/chosen"]
    assert trainer._prepare_eval_dataset(trainer.eval_dataset, "eval") is trainer.eval_dataset
    stream = IterableDataset.from_generator(lambda: iter(test))
    assert trainer.evaluate(eval_dataset=stream)["eval_logps/chosen"] == pytest.approx(metrics["eval_logps/chosen"])
    # A dict: one evaluation per dataset, transformers' prefixes for the loss.
    both = trainer.evaluate(eval_dataset={"first": test.select(range(4)), "second": test.select(range(4, 8))})
    assert {"eval_first_loss", "eval_second_loss"} <= set(both)


def test_compute_metrics_receives_logits_and_token_ids(tmp_path, model_path, unpaired):
    seen = {}

    def compute_metrics(prediction):
        seen["predictions"], seen["labels"] = prediction.predictions, prediction.label_ids
        return {"test": 1.0}

    test = unpaired["test"].select(range(6))
    trainer = KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=unpaired["train"].select(range(8)),
                         eval_dataset=test, compute_metrics=compute_metrics)  # fmt: skip
    metrics = trainer.evaluate()
    assert metrics["eval_test"] == 1.0 and "eval_rewards/chosen" in metrics
    predictions, labels = seen["predictions"], seen["labels"]
    batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(4)])
    width = batch["input_ids"].shape[1]
    assert predictions.shape[:2] == labels.shape and predictions.shape[0] == 6
    assert predictions.shape[2] == trainer.model.config.vocab_size
    assert (labels[:4, :width] == batch["input_ids"].numpy()).all()
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(torch.from_numpy(predictions[:4, :width]), logits, atol=1e-5)


def test_trl_public_attributes(tmp_path, model_path, unpaired):
    train = unpaired["train"].select(range(8))
    trainer = KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=train)
    assert (trainer.beta, trainer.loss_type, trainer.calculate_KL, trainer.precompute_ref_logps) == (0.1, "kto", True,
                                                                                                      False)  # fmt: skip
    assert (trainer.desirable_weight, trainer.undesirable_weight) == (1.0, 1.0)
    assert (trainer.aux_loss_enabled, trainer.router_aux_loss_coef) == (False, 0.0)
    args = make_args(tmp_path, loss_type="apo_zero_unpaired", beta=0.3, desirable_weight=1.5,
                     precompute_ref_log_probs=True)  # fmt: skip
    trainer = KTOTrainer(model_path, args=args, train_dataset=train)
    assert (trainer.beta, trainer.calculate_KL, trainer.desirable_weight, trainer.precompute_ref_logps) == (
        0.3, False, 1.5, True)  # fmt: skip
    # The loss reads the attributes: beta changed on the trainer changes the rewards.
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    perturb(trainer.model)
    trainer.compute_loss(trainer.model, batch)
    trainer.beta = 0.6
    trainer.compute_loss(trainer.model, batch)
    rewards = trainer._metrics[trainer._mode]["rewards/chosen"]
    assert rewards[1] == pytest.approx(2 * rewards[0], rel=1e-5)


def test_batch_size_one_is_rejected_for_the_kl_term(tmp_path, model_path, unpaired):
    train = unpaired["train"].select(range(4))
    with pytest.raises(ValueError, match=r"batch size must be > 1"):
        KTOTrainer(model_path, args=make_args(tmp_path, per_device_train_batch_size=1), train_dataset=train)
    # Without the KL term a batch of one is fine.
    args = make_args(tmp_path, per_device_train_batch_size=1, loss_type="apo_zero_unpaired")
    assert KTOTrainer(model_path, args=args, train_dataset=train).args.per_device_train_batch_size == 1


@pytest.mark.parametrize("strategy", ["random", "group_by_length"])
def test_shuffled_sampling_is_rejected_for_the_kl_term(tmp_path, model_path, unpaired, strategy):
    # The KL completions pair each example with its neighbours in a fixed-order batch: a sampler that reorders the
    # rows breaks the pairing, which TRL refuses at construction.
    train = unpaired["train"].select(range(4))
    args = make_args(tmp_path, train_sampling_strategy=strategy)
    with pytest.raises(ValueError, match=rf"requires `train_sampling_strategy='sequential'`.*Got .*'{strategy}'"):
        KTOTrainer(model_path, args=args, train_dataset=train)
    args = make_args(tmp_path, train_sampling_strategy=strategy, loss_type="apo_zero_unpaired")
    assert KTOTrainer(model_path, args=args, train_dataset=train).args.train_sampling_strategy == strategy


def test_total_flos_count_the_main_sequences_only(tmp_path, model_path, unpaired):
    trainer = KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=unpaired["train"].select(range(8)))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    expected = 6 * trainer.model.num_parameters(exclude_embeddings=True) * batch["input_ids"].numel()
    assert trainer.floating_point_ops(batch) == expected


@pytest.mark.parametrize("label", [True, False])
def test_single_label_data_warns_and_trains(tmp_path, model_path, unpaired, label):
    # One label only: the loss can push in one direction alone. TRL trains on such data, so it is a warning here.
    data = unpaired["train"].filter(lambda ex: ex["label"] == label)
    name = "desirable" if label else "undesirable"
    with pytest.warns(UserWarning, match=f"only {name} examples"):
        trainer = KTOTrainer(model_path, args=make_args(tmp_path, max_steps=1), train_dataset=data)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = trainer.state.log_history[0]
    assert math.isfinite(logged["loss"]) and math.isfinite(logged["kl"])
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_apo_zero_unpaired_streaming_and_gradient_accumulation(tmp_path, model_path, unpaired):
    data = unpaired["train"].select(range(8))
    stream = IterableDataset.from_generator(lambda: iter(data))
    trainer = KTOTrainer(model_path, args=make_args(tmp_path, loss_type="apo_zero_unpaired"), train_dataset=stream)
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.state.log_history[0]["kl"] == 0.0
    # The per-example mean makes equal-size micro-batches accumulate to the full batch's gradient.
    results = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        args = make_args(tmp_path / str(batch_size), loss_type="apo_zero_unpaired", optim="sgd", learning_rate=0.5,
                         per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation)  # fmt: skip
        trainer = KTOTrainer(model_path, args=args, train_dataset=data)
        assert "KL_completion_ids" not in trainer.train_dataset.column_names
        perturb(trainer.model)
        trainer.train()
        results.append(snapshot(trainer.model))
    for name, value in results[0].items():
        assert torch.allclose(value, results[1][name], atol=1e-6), name


def test_default_config_and_gradient_checkpointing(tmp_path, model_path, unpaired, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = KTOTrainer(model_path, train_dataset=unpaired["train"].select(range(8)))
    assert trainer.args.output_dir.endswith(f"{MODEL}-KTO") and trainer.args.gradient_checkpointing is True
    trainer.args.max_steps, trainer.args.report_to = 1, []
    trainer.train()
    assert trainer.state.global_step == 1


# ---------------------------------------------------------------------------------------------------------------------
# Reference model
# ---------------------------------------------------------------------------------------------------------------------
def test_peft_reference_and_precomputed_reference(tmp_path, model_path, unpaired):
    from peft import LoraConfig

    data = unpaired["train"].select(range(8))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = KTOTrainer(model_path, args=make_args(tmp_path, max_steps=1), train_dataset=data, peft_config=lora)
    assert trainer.ref_model is None
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ref = trainer.compute_ref_log_probs(trainer.model, batch)
    base = AutoModelForCausalLM.from_pretrained(model_path).eval()
    expected, _, _ = oracle_logps(base, batch)
    expected_kl, _, _ = oracle_logps(base, kl_rows(batch))
    assert torch.allclose(ref["ref_logps"], expected, atol=1e-5)
    assert torch.allclose(ref["ref_KL_logps"], expected_kl, atol=1e-5)
    before = snapshot(trainer.model)
    trainer.train()
    changed = changed_params(before, trainer.model)
    assert changed and all("lora" in name for name in changed)

    args = make_args(tmp_path, precompute_ref_log_probs=True, precompute_ref_batch_size=3)
    trainer = KTOTrainer(model_path, args=args, train_dataset=data)
    assert trainer.ref_model is None
    columns = trainer.train_dataset.column_names
    assert {"ref_logps", "ref_KL_logps"} <= set(columns)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    expected, _, _ = oracle_logps(base, batch)
    expected_kl, _, _ = oracle_logps(base, kl_rows(batch))
    assert torch.allclose(torch.tensor(trainer.train_dataset["ref_logps"]), expected, atol=1e-5)
    assert torch.allclose(torch.tensor(trainer.train_dataset["ref_KL_logps"]), expected_kl, atol=1e-5)
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)


def test_sync_ref_model(tmp_path, model_path, unpaired):
    args = make_args(tmp_path, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    trainer = KTOTrainer(model_path, args=args, train_dataset=unpaired["train"].select(range(8)))
    before = snapshot(trainer.ref_model)
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.ref_model.named_parameters())


# ---------------------------------------------------------------------------------------------------------------------
# Saving and resuming
# ---------------------------------------------------------------------------------------------------------------------
def test_save_reload_and_resume(tmp_path, model_path, unpaired):
    data = unpaired["train"].select(range(16))
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    trainer = KTOTrainer(model_path, args=args, train_dataset=data)
    trainer.train()
    assert_saved_model_reloads(trainer, tmp_path / "final")
    card = read_model_card(tmp_path)
    assert "kto" in card and "2402.01306" in card

    resumed = KTOTrainer(model_path, args=args, train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.state.global_step == 4
    assert_same_params(trainer.model, resumed.model, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: each a clear error before training
# ---------------------------------------------------------------------------------------------------------------------
def test_bad_inputs(tmp_path, model_path, unpaired):
    train = unpaired["train"]
    with pytest.raises(ValueError, match=r"'label' column of the train dataset must hold booleans.*found int64"):
        KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=train.cast_column("label", Value("int64")))
    with pytest.raises(ValueError, match=r"missing: \['prompt'\].*needs an explicit prompt"):
        KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=train.remove_columns("prompt"))
    with pytest.raises(ValueError, match=r"missing: \['label'\]"):
        KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=train.remove_columns("label"))
    with pytest.raises(ValueError, match="DatasetDict with splits"):
        KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=unpaired)
    with pytest.raises(ValueError, match="needs a `train_dataset`"):
        KTOTrainer(model_path, args=make_args(tmp_path))
    rows = [{"prompt": "word " * 30, "completion": " a", "label": True}] * 2
    with pytest.raises(ValueError, match=r"shortest prompt is \d+ tokens, expected fewer than max_length"):
        KTOTrainer(model_path, args=make_args(tmp_path, max_length=8), train_dataset=Dataset.from_list(rows))
    with pytest.raises(ValueError, match="cannot use `sync_ref_model=True` together with"):
        KTOTrainer(model_path, args=make_args(tmp_path, sync_ref_model=True, precompute_ref_log_probs=True),
                   train_dataset=train)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_path)
    with pytest.raises(ValueError, match="same object as `model`"):
        KTOTrainer(model, ref_model=model, args=make_args(tmp_path), train_dataset=train)
    stream = IterableDataset.from_generator(lambda: iter(train))
    with pytest.raises(ValueError, match="set args.max_steps"):
        KTOTrainer(model_path, args=make_args(tmp_path, max_steps=-1), train_dataset=stream)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_gradient_free_forwards_are_batched_and_exact(tmp_path, model_path, unpaired, loss_type):
    """The reference scores main and KL rows in one forward (none for the KL rows when the loss doesn't use them),
    and while policy == reference the KL estimate and the rewards are exactly 0, as in TRL."""
    args = make_args(tmp_path, loss_type=loss_type)
    trainer = KTOTrainer(model_path, args=args, train_dataset=unpaired["train"].select(range(8)))
    assert trainer._layout == "padding_free"
    trainer.model.train()
    examples = [dict(trainer.train_dataset[i]) for i in range(4)]
    if loss_type == "kto":  # KL rows packed wider than the main rows: the parts must still give the same bits
        examples[0]["KL_completion_ids"] = examples[0]["KL_completion_ids"] * 4
    batch = trainer.data_collator(examples)
    calls = {"policy": 0, "ref": 0}
    for name, model in (("policy", trainer.model), ("ref", trainer.ref_model)):
        model.model.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    trainer.compute_loss(trainer.model, batch)
    needs_kl = loss_type == "kto"
    assert calls == {"policy": 2 if needs_kl else 1, "ref": 1}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert metrics["rewards/chosen"] == 0.0 and metrics["rewards/rejected"] == 0.0
    if needs_kl:
        assert metrics["kl"] == 0.0
        one_pass = trainer.compute_ref_log_probs(trainer.model, batch)
        trainer._kl_in_reference_forward = False
        two_passes = trainer.compute_ref_log_probs(trainer.model, batch)
        for key, value in two_passes.items():
            torch.testing.assert_close(one_pass[key], value, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# KL rows continued from the main rows' prompt keys/values
# ---------------------------------------------------------------------------------------------------------------------
def _call_counter(calls, name):
    def hook(*_):
        calls[name] += 1

    return hook


def _rows(batch, prefix=""):
    return {key: batch[prefix + key] for key in ("input_ids", "attention_mask", "completion_mask")}


def test_kl_rows_continue_from_the_main_rows_prompts_under_gradient_checkpointing(tmp_path, model_path, unpaired):
    """Under gradient checkpointing (KTO's default) the policy and the reference run only the KL completions,
    continued from the main rows' recorded prompt keys/values: the losses of whole KL rows, KL estimate and rewards
    exactly 0 at the first step, and evaluation still works."""
    data, test = unpaired["train"].select(range(8)), unpaired["test"].select(range(4))
    logs = {}
    for share in (True, False):
        args = make_args(
            tmp_path / str(share), logging_steps=1, eval_strategy="steps", eval_steps=2, gradient_checkpointing=True
        )
        trainer = KTOTrainer(model_path, args=args, train_dataset=data, eval_dataset=test)
        assert trainer._share_kl_prefix
        trainer._share_kl_prefix = share
        calls = {"policy": 0, "ref": 0}
        for name, model in (("policy", trainer.model), ("ref", trainer.ref_model)):
            model.model.register_forward_hook(_call_counter(calls, name))
        before = snapshot(trainer.model)
        trainer.train()
        assert changed_params(before, trainer.model)
        # Per batch (2 training steps, 1 evaluation batch): main + KL continuation on each model when shared; the
        # policy's main and KL forwards and the reference's single packed forward otherwise.
        passes = getattr(trainer, "_shared_prefix_passes", 0)
        assert (passes, calls["ref"]) == ((6, 6) if share else (0, 3)) and calls["policy"] == 6
        logs[share] = [log for log in trainer.state.log_history if "loss" in log or "eval_loss" in log]
        first = logs[share][0]
        assert first["kl"] == 0.0 and first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0
    for shared, plain in zip(logs[True], logs[False], strict=True):
        assert shared.keys() == plain.keys()
        for key in (key for key in shared if "runtime" not in key and "per_second" not in key):
            assert shared[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


def test_kl_prefix_fallback_reasons(tmp_path, model_path, unpaired):
    data = unpaired["train"].select(range(8))
    trainer = KTOTrainer(model_path, args=make_args(tmp_path), train_dataset=data)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    main, kl = _rows(batch), _rows(batch, "KL_")
    # The attention function that records keys/values is switched in while training (`_training_kernels`) only.
    assert "attend through" in trainer._kl_prefix_fallback_reason(batch, main, kl)
    with trainer._training_kernels():
        assert trainer._kl_prefix_fallback_reason(batch, main, kl) is None
        assert "images" in trainer._kl_prefix_fallback_reason({**batch, "pixel_values": torch.zeros(1)}, main, kl)
        left = {**kl, "attention_mask": kl["attention_mask"].flip(1), "input_ids": kl["input_ids"].flip(1)}
        assert "right-padded" in trainer._kl_prefix_fallback_reason(batch, main, left)
        other = {**kl, "input_ids": kl["input_ids"] + 1}  # no shared prompt
        assert "would save 0%" in trainer._kl_prefix_fallback_reason(batch, main, other)
        # NEFTune's noise on the embeddings, dropout: the KL rows need their own pass, run first as under TRL.
        handle = trainer.model.get_input_embeddings().register_forward_hook(lambda module, args, output: output)
        assert "random numbers" in trainer._kl_prefix_fallback_reason(batch, main, kl)
        handle.remove()
        attention = trainer.model.model.layers[0].self_attn
        attention.attention_dropout, attention.training = 0.1, True
        assert "random numbers" in trainer._kl_prefix_fallback_reason(batch, main, kl)
        attention.attention_dropout = 0.0
        assert trainer._kl_prefix_fallback_reason(batch, main, kl) is None
        trainer.model_wrapped = torch.nn.Module()
        assert "wrapped" in trainer._kl_prefix_fallback_reason(batch, main, kl)
    for kwargs in ({"precompute_ref_log_probs": True}, {"model_init_kwargs": {"attn_implementation": "eager"}}):
        other_trainer = KTOTrainer(model_path, args=make_args(tmp_path, **kwargs), train_dataset=data)
        assert not other_trainer._share_kl_prefix, kwargs
        assert "does not share" in other_trainer._kl_prefix_fallback_reason(batch, main, kl)

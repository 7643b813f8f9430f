"""Experimental BCOTrainer: the loss and its running reward shift, UDM density-ratio weights, training, checkpoints."""

import json
import math
import os

import numpy as np
import pytest
import torch
from datasets import Dataset, Value
from trainer_utils import (
    PREFERENCE_ARGS,
    args_builder,
    assert_same_params,
    assert_saved_model_reloads,
    changed_params,
    read_model_card,
    snapshot,
)
from transformers import AutoModelForCausalLM

from trl.assets import get_model_path, load_test_dataset
from trl.experimental.bco import BCOConfig, BCOTrainer
from trl.experimental.bco.bco_trainer import RunningMoments


pytest.importorskip("sklearn")

METRICS = [
    "delta",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
]
# The per-class sums and counts behind the means are not logged (as TRL 1.12).
NOT_LOGGED = ["rewards/chosen_sum", "rewards/rejected_sum", "count/chosen", "count/rejected"]


make_args = args_builder(BCOConfig, **PREFERENCE_ARGS)


# ---------------------------------------------------------------------------------------------------------------------
# Config and running moments
# ---------------------------------------------------------------------------------------------------------------------
def test_config_defaults_match_contract():
    args = BCOConfig("out")
    assert args.learning_rate == 5e-7 and args.beta == 0.1
    assert (args.max_length, args.max_completion_length) == (1024, None)
    assert (args.prompt_sample_size, args.min_density_ratio, args.max_density_ratio) == (1024, 0.5, 10.0)
    assert args.disable_dropout is True and args.generate_during_eval is False and args.is_encoder_decoder is None
    assert args.precompute_ref_log_probs is False and args.model_init_kwargs is None
    assert args.trust_remote_code is False and args.dataset_num_proc is None
    assert args.logging_steps == 10 and args.gradient_checkpointing is True
    with pytest.raises(ValueError, match="min_density_ratio <= max_density_ratio"):
        BCOConfig("out", min_density_ratio=2.0, max_density_ratio=1.0)


def test_running_moments_pool_every_value(tmp_path):
    moments = RunningMoments()
    first, second = [0.5, -1.0, 2.0], [3.0, 1.5]
    moments.update(torch.tensor(first))
    assert moments.mean == pytest.approx(np.mean(first))
    moments.update(torch.tensor(second))
    values = first + second
    assert moments.mean == pytest.approx(np.mean(values))
    assert moments.var == pytest.approx(np.var(values))
    assert moments.std == pytest.approx(np.std(values, ddof=1))
    moments.save_to_json(str(tmp_path / "running.json"))
    loaded = RunningMoments.load_from_json(None, str(tmp_path / "running.json"))
    assert (loaded.mean, loaded.var, loaded.count) == (moments.mean, moments.var, moments.count)


# ---------------------------------------------------------------------------------------------------------------------
# Loss against the hand-written formula, with the running reward shift delta
# ---------------------------------------------------------------------------------------------------------------------
def logsig(x):
    return -math.log1p(math.exp(-x))


def test_bco_loss_formula_with_running_delta(tmp_path, model_path, unpaired):
    trainer = BCOTrainer(
        model_path, args=make_args(tmp_path, beta=0.2), train_dataset=unpaired["train"].select(range(4))
    )
    t = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    batches = [
        ([-5.0, -8.0], [-6.0, -4.0], [-5.5, -7.5], [-5.0, -4.5]),
        ([-3.0], [-9.0, -2.0, -7.0], [-4.0], [-8.0, -2.5, -6.0]),
    ]
    seen = []
    for chosen, rejected, ref_chosen, ref_rejected in batches:
        rewards_c = [0.2 * (p - r) for p, r in zip(chosen, ref_chosen)]
        rewards_r = [0.2 * (p - r) for p, r in zip(rejected, ref_rejected)]
        seen += rewards_c + rewards_r
        delta = sum(seen) / len(seen)  # running mean of every reward so far, this batch included
        expected = [-logsig(r - delta) for r in rewards_c] + [-logsig(-(r - delta)) for r in rewards_r]
        losses, out_c, out_r, out_delta = trainer.bco_loss(t(chosen), t(rejected), t(ref_chosen), t(ref_rejected))
        assert out_delta.item() == pytest.approx(delta, abs=1e-12)
        assert torch.allclose(losses, t(expected), rtol=1e-10, atol=1e-12)
        assert torch.allclose(out_c, t(rewards_c)) and torch.allclose(out_r, t(rewards_r))
    # Evaluation batches do not move delta; undesirable losses are multiplied by their weights.
    weights = t([2.0, 0.5])
    losses, _, _, out_delta = trainer.bco_loss(t([-1.0]), t([-2.0, -3.0]), t([-1.0]), t([-2.5, -2.0]),
                                               do_train=False, rejected_weights=weights)  # fmt: skip
    assert out_delta.item() == pytest.approx(delta, abs=1e-12)
    rewards_r = [0.2 * 0.5, 0.2 * -1.0]
    expected = [-logsig(0.0 - delta)] + [w * -logsig(-(r - delta)) for w, r in zip([2.0, 0.5], rewards_r)]
    assert torch.allclose(losses, t(expected), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# Underlying distribution matching
# ---------------------------------------------------------------------------------------------------------------------
WORDS = (" red", " blue", " green")


def toy_udm_dataset():
    """Desirable prompts are mostly about red, undesirable ones mostly about blue; the classes overlap."""
    generator = np.random.default_rng(0)
    rows = []
    for i in range(40):
        label = i % 2 == 0
        counts = generator.poisson([2.0, 0.7, 1.0] if label else [0.7, 2.0, 1.0])
        prompt = "Colours:" + "".join(word * int(c) for word, c in zip(WORDS, counts))
        rows.append({"prompt": prompt, "completion": " ok.", "label": label})
    return Dataset.from_list(rows)


def word_count_embedding(tokenizer):
    """Toy embedding: how many times each colour word's token occurs in the prompt."""
    ids = [tokenizer(word, add_special_tokens=False)["input_ids"] for word in WORDS]
    assert all(len(i) == 1 for i in ids)
    ids = torch.tensor([i[0] for i in ids])

    def embed(input_ids, attention_mask):
        hits = (input_ids.unsqueeze(-1) == ids) & attention_mask.bool().unsqueeze(-1)
        return hits.sum(dim=1).float()

    return embed, ids


def test_udm_weights_equal_hand_computed_density_ratio(tmp_path, model_path, tokenizer):
    data = toy_udm_dataset()
    embed, ids = word_count_embedding(tokenizer)
    args = make_args(tmp_path, prompt_sample_size=1000, min_density_ratio=0.3, max_density_ratio=3.0)
    trainer = BCOTrainer(model_path, args=args, train_dataset=data, processing_class=tokenizer,
                         embedding_func=embed, embedding_tokenizer=tokenizer)  # fmt: skip
    features = np.array(
        [[row["prompt"].count(word) for word in WORDS] for row in data], dtype=np.float64
    )  # the toy embedding, counted on the raw text
    labels = np.array(data["label"], dtype=np.float64)

    # The classifier is an L2-regularised (C = 1), class-balanced logistic regression fit on every prompt: check the
    # first-order optimality conditions of that objective at its coefficients.
    w, b = trainer.clf.coef_[0].astype(np.float64), float(trainer.clf.intercept_[0])
    y = 2 * labels - 1
    sample_weight = np.where(labels == 1, len(labels) / (2 * labels.sum()), len(labels) / (2 * (1 - labels).sum()))
    z = features @ w + b
    residual = sample_weight * y / (1 + np.exp(y * z))  # -d(loss_i)/dz_i
    # (The gradient is zero up to the solver's tolerance; coefficients are of order 1.)
    assert np.allclose(w - features.T @ residual, 0, atol=5e-3)
    assert abs(residual.sum()) < 5e-3

    # Density ratio p / (1 - p) = exp(z) for undesirable examples, clamped; desirable examples weigh 1.
    expected = np.where(labels == 1, 1.0, np.clip(np.exp(z), 0.3, 3.0))
    assert np.allclose(trainer.train_dataset["udm_weight"], expected, rtol=1e-5)
    assert (expected == 0.3).any() and (expected == 3.0).any() and ((expected > 0.3) & (expected < 3.0)).any()

    # The weights reach the loss through the batch.
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert torch.allclose(batch["udm_weight"], torch.tensor(expected[:4], dtype=torch.float32))


def test_train_with_udm_save_and_resume(tmp_path, model_path, tokenizer):
    data = toy_udm_dataset()
    embed, _ = word_count_embedding(tokenizer)
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=4,
                     prompt_sample_size=8)  # fmt: skip
    kwargs = dict(processing_class=tokenizer, embedding_func=embed, embedding_tokenizer=tokenizer)
    trainer = BCOTrainer(model_path, args=args, train_dataset=data, eval_dataset=data.select(range(8)), **kwargs)
    assert trainer.clf.n_features_in_ == 3
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert train_logs[0]["loss"] > 0 and train_logs[0]["delta"] == 0.0  # policy == reference at step 1
    for key in METRICS:
        assert key in train_logs[-1] and math.isfinite(train_logs[-1][key]), key
    eval_log = next(log for log in trainer.state.log_history if "eval_loss" in log)
    assert eval_log["eval_delta"] == pytest.approx(trainer.running.mean)

    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / "running.json").is_file() and (checkpoint / "clf.pkl").is_file()
    with open(checkpoint / "running.json") as f:
        saved = json.load(f)
    assert_saved_model_reloads(trainer, tmp_path / "final")
    assert "2404.04656" in read_model_card(tmp_path)

    resumed = BCOTrainer(model_path, args=args, train_dataset=data, eval_dataset=data.select(range(8)), **kwargs)
    loaded = {}
    original = resumed._load_from_checkpoint

    def spy(path, model=None):
        original(path, model)
        loaded["mean"] = resumed.running.mean

    resumed._load_from_checkpoint = spy
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert loaded["mean"] == pytest.approx(saved["mean"])  # delta continues from the checkpoint
    assert resumed.state.global_step == 4
    assert resumed.running.mean == pytest.approx(trainer.running.mean, abs=1e-6)
    assert_same_params(trainer.model, resumed.model, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Training without UDM
# ---------------------------------------------------------------------------------------------------------------------
def test_only_desirable_examples_and_peft_reference(tmp_path, model_path, unpaired):
    from peft import LoraConfig

    desirable = unpaired["train"].filter(lambda ex: ex["label"])
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = BCOTrainer(model_path, args=make_args(tmp_path), train_dataset=desirable, peft_config=lora)
    assert trainer.ref_model is None
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    base = AutoModelForCausalLM.from_pretrained(model_path).eval()
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    token_logps = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["completion_mask"][:, 1:] * batch["attention_mask"][:, 1:]
    assert torch.allclose(trainer.compute_reference_log_probs(batch), (token_logps * mask).sum(1), atol=1e-5)
    before = snapshot(trainer.model)
    trainer.train()
    changed = changed_params(before, trainer.model)
    assert changed and all("lora" in name for name in changed)
    log = trainer.state.log_history[-2]
    assert math.isfinite(log["rewards/chosen"]) and "rewards/rejected" not in log  # no undesirable example
    assert not any(key in log for key in NOT_LOGGED)


def test_evaluate_prepares_raw_datasets(tmp_path, model_path, tokenizer, unpaired):
    test = unpaired["test"].select(range(8))
    trainer = BCOTrainer(model_path, args=make_args(tmp_path), train_dataset=unpaired["train"].select(range(8)),
                         eval_dataset=test)  # fmt: skip
    metrics = trainer.evaluate()
    # A raw dataset is prepared like the constructor's eval_dataset; a prepared one is used as it is.
    raw = trainer.evaluate(eval_dataset=test)
    assert raw["eval_loss"] == metrics["eval_loss"] and raw["eval_logps/chosen"] == metrics["eval_logps/chosen"]
    assert trainer._prepare_eval_dataset(trainer.eval_dataset, "eval") is trainer.eval_dataset
    both = trainer.evaluate(eval_dataset={"first": test.select(range(4)), "second": test.select(range(4, 8))})
    assert {"eval_first_loss", "eval_second_loss"} <= set(both)
    # `predict()` on the raw dataset: each example's implied reward (0 while the policy is the reference) and its
    # label (1 desirable, 0 undesirable), in dataset order.
    predicted = trainer.predict(test)
    assert predicted.label_ids.tolist() == [int(label) for label in test["label"]]
    assert predicted.predictions.shape == (8,) and np.allclose(predicted.predictions, 0.0, atol=1e-6)
    assert predicted.metrics["test_loss"] == pytest.approx(metrics["eval_loss"])
    # With UDM the raw dataset also gets its density-ratio weights.
    data = toy_udm_dataset()
    embed, _ = word_count_embedding(tokenizer)
    args = make_args(tmp_path / "udm", prompt_sample_size=8)
    trainer = BCOTrainer(model_path, args=args, train_dataset=data, eval_dataset=data.select(range(8)),
                         processing_class=tokenizer, embedding_func=embed, embedding_tokenizer=tokenizer)  # fmt: skip
    prepared = trainer._prepare_eval_dataset(data.select(range(8)), "eval")
    assert prepared["udm_weight"] == trainer.eval_dataset["udm_weight"]
    assert trainer.evaluate(eval_dataset=data.select(range(8)))["eval_loss"] == trainer.evaluate()["eval_loss"]


def test_model_loading_options(tmp_path, model_path, unpaired):
    data = unpaired["train"].select(range(4))
    args = make_args(tmp_path, model_init_kwargs={"dtype": "float32"}, precompute_ref_log_probs=True,
                     max_completion_length=2)  # fmt: skip
    trainer = BCOTrainer(model_path, args=args, train_dataset=data)
    assert trainer.model.dtype == torch.float32 and trainer.ref_model is None
    assert "ref_logps" in trainer.train_dataset.column_names
    rows = trainer.train_dataset
    assert max(len(c) - len(p) for p, c in zip(rows["prompt_input_ids"], rows["completion_input_ids"])) == 2
    trainer = BCOTrainer(
        model_init=lambda: AutoModelForCausalLM.from_pretrained(model_path), args=make_args(tmp_path),
        train_dataset=data,
    )  # fmt: skip
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model


# ---------------------------------------------------------------------------------------------------------------------
# TRL 1.12's prepared columns and its logits metric
# ---------------------------------------------------------------------------------------------------------------------
BCO_COLUMNS = (
    "prompt completion label prompt_input_ids prompt_attention_mask answer_input_ids answer_attention_mask "
    "completion_input_ids completion_attention_mask completion_labels"
).split()


def test_prepared_columns_as_trl(tmp_path, model_path, tokenizer, unpaired):
    eos = tokenizer.eos_token_id
    data = unpaired["train"].select(range(4))
    trainer = BCOTrainer(model_path, args=make_args(tmp_path), train_dataset=data, eval_dataset=data)
    assert trainer.train_dataset.column_names == BCO_COLUMNS == trainer.eval_dataset.column_names
    row, raw = trainer.train_dataset[0], data[0]
    prompt = tokenizer(raw["prompt"])["input_ids"]
    answer = tokenizer(raw["prompt"] + raw["completion"])["input_ids"][len(prompt) :]
    assert (row["prompt"], row["completion"], row["label"]) == (raw["prompt"], raw["completion"], raw["label"])
    assert row["prompt_input_ids"] == prompt and row["answer_input_ids"] == answer
    assert row["completion_input_ids"] == prompt + answer + [eos]
    assert row["completion_labels"] == [-100] * len(prompt) + answer + [eos]
    for name in ("prompt", "answer", "completion"):
        assert row[f"{name}_attention_mask"] == [1] * len(row[f"{name}_input_ids"])
    # The collator reads these columns: the completion tokens are scored, the prompt is not.
    batch = trainer.data_collator([row])
    assert batch["input_ids"][0].tolist() == row["completion_input_ids"]
    assert batch["completion_mask"][0].tolist() == [int(label != -100) for label in row["completion_labels"]]
    # A prepared dataset is used as it is.
    assert (
        trainer._prepare_bco_dataset(trainer.train_dataset, tokenizer, trainer.args, "train") is trainer.train_dataset
    )

    # Conversational rows keep the rendered chat-template text; the completion (ending with the template's newline)
    # still gets EOS in `completion_input_ids`, not in `answer_input_ids`.
    chat = load_test_dataset("conversational_unpaired_preference", split="train").select(range(2))
    trainer = BCOTrainer(model_path, args=make_args(tmp_path / "chat"), train_dataset=chat)
    row = trainer.train_dataset[0]
    assert trainer.train_dataset.column_names == BCO_COLUMNS
    assert row["prompt"] == tokenizer.apply_chat_template(
        chat[0]["prompt"], tokenize=False, add_generation_prompt=True
    )
    full = tokenizer.apply_chat_template(chat[0]["prompt"] + chat[0]["completion"], tokenize=False)
    assert row["prompt"] + row["completion"] == full
    assert row["completion_input_ids"] == row["prompt_input_ids"] + row["answer_input_ids"] + [eos]
    assert row["answer_input_ids"][-1] != eos

    # Paired data: per batch of pairs, every chosen row, then every rejected row (TRL's order, read sequentially).
    paired = load_test_dataset("standard_preference", split="train").select(range(3))
    trainer = BCOTrainer(model_path, args=make_args(tmp_path / "paired"), train_dataset=paired)
    assert list(trainer.train_dataset["label"]) == [True, True, True, False, False, False]
    assert list(trainer.train_dataset["completion"]) == list(paired["chosen"]) + list(paired["rejected"])


def test_logits_metric_sums_every_position_of_padded_batch(tmp_path, model_path, unpaired):
    """`logits/<class>`: per example, the sum of the full logits over the vocabulary and over every position of the
    right-padded batch (prompt and padding included), averaged over the class's examples of the logging interval."""
    data = unpaired["train"].select(range(8))
    args = make_args(tmp_path, max_steps=1, logging_steps=1, gradient_accumulation_steps=2)
    trainer = BCOTrainer(model_path, args=args, train_dataset=data)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    per_example, labels = [], []
    for start in (0, 4):  # the two micro-batches of the step, in dataset order
        rows = [data[i] for i in range(start, start + 4)]
        prompts = [trainer.processing_class(row["prompt"])["input_ids"] for row in rows]
        sequences = [
            trainer.processing_class(row["prompt"] + row["completion"])["input_ids"]
            + [trainer.processing_class.eos_token_id]
            for row in rows
        ]
        assert all(seq[: len(p)] == p for seq, p in zip(sequences, prompts))
        width = max(len(seq) for seq in sequences)
        pad = trainer.processing_class.pad_token_id
        input_ids = torch.tensor([seq + [pad] * (width - len(seq)) for seq in sequences])
        attention_mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in sequences])
        assert (attention_mask == 0).any()  # padding positions are part of the sum
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.double()
        per_example.append(logits.sum(dim=(1, 2)))
        labels += [row["label"] for row in rows]
    per_example, labels = torch.cat(per_example), torch.tensor(labels)
    assert labels.any() and (~labels).any()
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["logits/chosen"] == pytest.approx(per_example[labels].mean().item(), rel=1e-5)
    assert log["logits/rejected"] == pytest.approx(per_example[~labels].mean().item(), rel=1e-5)

    # `forward` returns the same per-example sums (policy == the untrained model here).
    fresh = BCOTrainer(model_path, args=make_args(tmp_path / "fresh"), train_dataset=data)
    batch = fresh.data_collator([fresh.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        _, _, chosen_logits, rejected_logits = fresh.forward(fresh.model, batch)
    expected = per_example[:4]
    assert torch.allclose(chosen_logits.double(), expected[labels[:4]], rtol=1e-5)
    assert torch.allclose(rejected_logits.double(), expected[~labels[:4]], rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: each a clear error before training
# ---------------------------------------------------------------------------------------------------------------------
def test_bad_inputs(tmp_path, model_path, tokenizer, unpaired):
    train = unpaired["train"]
    args = make_args(tmp_path)
    with pytest.raises(ValueError, match="no embedding_func"):
        BCOTrainer(model_path, args=args, train_dataset=train, embedding_tokenizer=tokenizer)
    with pytest.raises(ValueError, match="no embedding_tokenizer"):
        BCOTrainer(model_path, args=args, train_dataset=train, embedding_func=lambda **kw: None)
    embed, _ = word_count_embedding(tokenizer)
    with pytest.raises(ValueError, match="has 24 desirable and 0 undesirable"):
        BCOTrainer(model_path, args=args, train_dataset=train.filter(lambda ex: ex["label"]), embedding_func=embed,
                   embedding_tokenizer=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="must hold booleans"):
        BCOTrainer(model_path, args=args, train_dataset=train.cast_column("label", Value("int64")))
    with pytest.raises(ValueError, match=r"missing: \['prompt'\]"):
        BCOTrainer(model_path, args=args, train_dataset=train.remove_columns("prompt"))
    with pytest.raises(ValueError, match="encoder-decoder"):
        BCOTrainer(get_model_path("tiny-T5ForConditionalGeneration"), args=args, train_dataset=train)
    with pytest.raises(ValueError, match="or a `model_init`"):
        BCOTrainer(None, args=args, train_dataset=train)
    with pytest.raises(ValueError, match="needs a `train_dataset`"):
        BCOTrainer(model_path, args=args)
    assert not os.path.exists(tmp_path / "checkpoint-1")


# ---------------------------------------------------------------------------------------------------------------------
# The step's hooks and the order of its passes
# ---------------------------------------------------------------------------------------------------------------------
def test_reference_first_trains_as_policy_first(tmp_path, model_path, unpaired, monkeypatch):
    """The reference scores the batch before the policy's forward (so that the policy may keep its last layers'
    activations); TRL's order, policy first, gives the same losses and parameters."""
    data = unpaired["train"].select(range(8))
    args = make_args(tmp_path, gradient_checkpointing=True)
    first = BCOTrainer(model_path, args=args, train_dataset=data)
    assert not first._reference_pass_after_policy_forward
    first.train()
    monkeypatch.setattr(BCOTrainer, "_reference_pass_after_policy_forward", True)
    second = BCOTrainer(model_path, args=make_args(tmp_path / "b", gradient_checkpointing=True), train_dataset=data)
    second.train()
    losses = [[log["loss"] for log in t.state.log_history if "loss" in log] for t in (first, second)]
    assert losses[0] == losses[1]
    assert_same_params(first.model, second.model, atol=1e-6)


@pytest.mark.parametrize("peft", [False, True], ids=["reference_model", "adapters_off"])
def test_overridden_forward_scores_policy_then_reference(tmp_path, model_path, unpaired, peft):
    """As TRL 1.12 (observed): a subclass's `forward` is called for the policy (with gradients), then for the
    reference (without): the reference model, or the policy with its adapters off; the reference no longer runs
    first."""
    from peft import LoraConfig

    calls = []

    class Spy(BCOTrainer):
        def forward(self, model, batch):
            adapters_on = not peft or model.base_model.model.model.layers[0].self_attn.q_proj.disable_adapters is False
            calls.append((model is self.model, torch.is_grad_enabled(), adapters_on))
            return super().forward(model, batch)

    data = unpaired["train"].select(range(8))
    extra = {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)}
    extra = extra if peft else {}
    torch.manual_seed(0)  # BCO's adapters draw from the global generator (as TRL 1.12's), so both start alike
    plain = BCOTrainer(model_path, args=make_args(tmp_path), train_dataset=data, **extra)
    plain.train()
    torch.manual_seed(0)
    spy = Spy(model_path, args=make_args(tmp_path / "spy"), train_dataset=data, **extra)
    assert spy._reference_pass_after_policy_forward
    spy.train()
    assert calls == [(True, True, True), (peft, False, not peft)] * 2
    losses = [[log["loss"] for log in t.state.log_history if "loss" in log] for t in (plain, spy)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert_same_params(plain.model, spy.model, atol=1e-5)

"""RewardTrainer: data preparation, the Bradley-Terry loss, metrics, PEFT, saving/resuming and bad input."""

import logging
import os

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset, IterableDataset
from trainer_utils import SGD_STEP_ARGS, args_builder, changed_params, sgd_step_update, snapshot
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from trl import RewardConfig, RewardTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.trainer.reward_trainer import DataCollatorForPreference


MODEL = "tiny-Qwen2ForSequenceClassification"
REWARD_METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")


@pytest.fixture(scope="module")
def model_path():
    """Overrides the conftest fixture (and so the `tokenizer` fixture): this module trains the sequence-classification model."""
    return get_model_path(MODEL)


make_args = args_builder(
    RewardConfig, max_steps=3, per_device_train_batch_size=2, per_device_eval_batch_size=16, learning_rate=1e-3
)


def reward_alone(model, ids):
    """Reward of one unpadded sequence, computed on its own."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].float()


# ---------------------------------------------------------------------------------------------------------------------
# Training on every dataset format, metrics
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config_name",
    [
        "standard_preference",
        "standard_implicit_prompt_preference",
        "conversational_preference",
        "conversational_implicit_prompt_preference",
    ],
)
def test_train_each_format(tmp_path, model_path, config_name):
    dataset = load_test_dataset(config_name)
    args = make_args(tmp_path, eval_strategy="steps", eval_steps=3)
    trainer = RewardTrainer(model=model_path, args=args, train_dataset=dataset["train"], eval_dataset=dataset["test"])
    # As in TRL: the given columns stay beside the token ids.
    expected = {"chosen", "rejected", "chosen_ids", "rejected_ids"} | (
        {"prompt"} if "prompt" in dataset["train"].column_names else set()
    )
    assert set(trainer.train_dataset.column_names) == expected
    before = snapshot(trainer.model)
    trainer.train()
    changed = changed_params(before, trainer.model, trainable_only=False)
    assert any(name.startswith("score.") for name in changed) and len(changed) > 1
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(train_logs) == 3
    for key in ("loss", "num_tokens", *REWARD_METRICS):
        assert key in train_logs[-1], key
    assert train_logs[-1]["num_tokens"] > train_logs[0]["num_tokens"] > 0
    last = train_logs[-1]
    assert last["min_reward"] <= last["mean_reward"] <= last["max_reward"]
    assert 0.0 <= last["accuracy"] <= 1.0
    eval_logs = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert eval_logs and all(f"eval_{key}" in eval_logs[-1] for key in REWARD_METRICS)
    # As in TRL: evaluation logs the number of training tokens seen so far.
    assert eval_logs[-1]["eval_num_tokens"] == last["num_tokens"]


def test_num_tokens_counts_both_sides(tmp_path, model_path, tokenizer):
    dataset = Dataset.from_dict({"chosen": ["one two three"], "rejected": ["four"]})
    trainer = RewardTrainer(model=model_path, args=make_args(tmp_path, max_steps=1), train_dataset=dataset)
    trainer.train()
    row = trainer.train_dataset[0]
    expected = len(row["chosen_ids"]) + len(row["rejected_ids"])
    assert [log["num_tokens"] for log in trainer.state.log_history if "loss" in log] == [expected]


def test_default_config(tmp_path, model_path, monkeypatch):
    """args=None: `<model>-Reward`, the contract defaults, gradient checkpointing on; a step runs on CPU."""
    monkeypatch.chdir(tmp_path)
    dataset = load_test_dataset("standard_preference", split="train").select(range(4))
    trainer = RewardTrainer(model=model_path, train_dataset=dataset)
    args = trainer.args
    assert args.output_dir.endswith(f"{MODEL}-Reward")
    assert (args.learning_rate, args.max_length, args.center_rewards_coefficient) == (1e-4, 1024, None)
    assert (args.disable_dropout, args.gradient_checkpointing, args.logging_steps, args.bf16) == (
        True,
        True,
        10,
        False,
    )
    assert args.pad_to_multiple_of is None  # "auto" off Neuron devices
    args.max_steps, args.report_to = 1, []
    trainer.train()
    assert trainer.state.global_step == 1


def test_config_options():
    assert RewardConfig("out", pad_to_multiple_of="64").pad_to_multiple_of == 64
    assert RewardConfig("out", pad_to_multiple_of="none").pad_to_multiple_of is None
    assert RewardConfig("out", model_init_kwargs='{"dtype": "float32"}').model_init_kwargs == {"dtype": "float32"}
    with pytest.warns(FutureWarning, match="pad_token"):
        RewardConfig("out", pad_token="<|endoftext|>")
    with pytest.warns(UserWarning, match="center_rewards_coefficient"):  # TRL trains with it: a warning only
        assert RewardConfig("out", center_rewards_coefficient=-1.0).center_rewards_coefficient == -1.0


# ---------------------------------------------------------------------------------------------------------------------
# Tokenization and batching
# ---------------------------------------------------------------------------------------------------------------------
def test_standard_tokenization_prepends_prompt_and_ends_with_eos(tmp_path, model_path, tokenizer):
    dataset = Dataset.from_dict({"prompt": ["The sky is"], "chosen": [" blue."], "rejected": [" green."]})
    trainer = RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    row = trainer.train_dataset[0]
    eos = tokenizer.eos_token_id
    assert row["chosen_ids"] == tokenizer("The sky is blue.")["input_ids"] + [eos]
    assert row["rejected_ids"] == tokenizer("The sky is green.")["input_ids"] + [eos]
    # the text columns hold what was tokenized (as in TRL)
    assert row["prompt"] == "The sky is"
    assert (row["chosen"], row["rejected"]) == (
        "The sky is blue." + tokenizer.eos_token,
        "The sky is green." + tokenizer.eos_token,
    )

    # an explicit eos_token override is used instead
    trainer = RewardTrainer(
        model=model_path, args=make_args(tmp_path, eos_token="<|endoftext|>"), train_dataset=dataset
    )
    assert trainer.train_dataset[0]["chosen_ids"][-1] == tokenizer.convert_tokens_to_ids("<|endoftext|>")


def test_conversational_tokenization_uses_chat_template(tmp_path, model_path, tokenizer):
    dataset = load_test_dataset("conversational_preference", split="train").select(range(2))
    trainer = RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    for row, example in zip(trainer.train_dataset, dataset):
        for key in ("chosen", "rejected"):
            expected = tokenizer.apply_chat_template(
                example["prompt"] + example[key], tokenize=True, return_dict=True
            )["input_ids"]
            assert row[f"{key}_ids"] == list(expected)
            assert row[key] == example["prompt"] + example[key]  # the kept column is the whole conversation
    text = tokenizer.decode(trainer.train_dataset[0]["chosen_ids"])
    assert text.startswith("<|im_start|>system") and "<|im_start|>assistant\n3 + 18 = 21.<|im_end|>" in text


def test_chat_template_path_jinja_file(tmp_path, model_path):
    import trl

    template = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "tiny_qwen2_5.jinja")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = None
    dataset = load_test_dataset("conversational_implicit_prompt_preference", split="train").select(range(4))
    trainer = RewardTrainer(
        model=model_path,
        args=make_args(tmp_path, chat_template_path=template, max_steps=1),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    assert "<|im_start|>" in trainer.processing_class.decode(trainer.train_dataset[0]["chosen_ids"])
    trainer.train()


@pytest.mark.parametrize("names", [("chosen_input_ids", "rejected_input_ids"), ("chosen_ids", "rejected_ids")])
def test_pretokenized_pairs_with_margin(tmp_path, model_path, names):
    dataset = Dataset.from_dict(
        {names[0]: [[1, 2, 3], [4, 5]], names[1]: [[6, 7], [8, 9, 10, 11]], "margin": [0.5, 1.0], "extra": ["a", "b"]}
    )
    trainer = RewardTrainer(model=model_path, args=make_args(tmp_path, max_steps=1), train_dataset=dataset)
    assert sorted(trainer.train_dataset.column_names) == ["chosen_ids", "extra", "margin", "rejected_ids"]
    assert trainer.train_dataset[1]["rejected_ids"] == [8, 9, 10, 11]
    trainer.train()


def test_collator_stacks_chosen_then_rejected():
    collator = DataCollatorForPreference(pad_token_id=0, pad_to_multiple_of=4)
    batch = collator(
        [
            {"chosen_ids": [1, 2, 3], "rejected_ids": [4, 5], "margin": 0.5},
            {"chosen_ids": [6], "rejected_ids": [7, 8, 9, 10, 11], "margin": 2},
        ]
    )
    assert batch["input_ids"].tolist() == [
        [1, 2, 3, 0, 0, 0, 0, 0],
        [6, 0, 0, 0, 0, 0, 0, 0],
        [4, 5, 0, 0, 0, 0, 0, 0],
        [7, 8, 9, 10, 11, 0, 0, 0],
    ]
    assert batch["attention_mask"].sum(dim=1).tolist() == [3, 1, 2, 5]
    assert batch["margin"].tolist() == [0.5, 2.0] and batch["margin"].dtype == torch.float32
    assert "margin" not in collator([{"chosen_ids": [1], "rejected_ids": [2]}])


def test_rewards_read_at_last_token_with_right_padding(tmp_path, model_path):
    """In one padded batch each reward equals the reward of the same sequence run alone."""
    dataset = load_test_dataset("standard_preference", split="train").select(range(3))
    trainer = RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    model = trainer.model.eval()
    rows = [trainer.train_dataset[i] for i in range(3)]
    batch = trainer.data_collator(rows)
    assert batch["attention_mask"].min() == 0  # the batch really is padded
    with torch.no_grad():
        _, outputs = trainer.compute_loss(model, batch, return_outputs=True)
    expected_chosen = torch.stack([reward_alone(model, r["chosen_ids"]) for r in rows])
    expected_rejected = torch.stack([reward_alone(model, r["rejected_ids"]) for r in rows])
    torch.testing.assert_close(outputs["rewards_chosen"], expected_chosen, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs["rewards_rejected"], expected_rejected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Loss against hand-written formulas
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("center", [None, 0.5])
@pytest.mark.parametrize("with_margin", [False, True])
def test_loss_matches_hand_written_formula(tmp_path, model_path, center, with_margin):
    dataset = load_test_dataset("standard_preference", split="train").select(range(4))
    margins = [0.0, 0.5, 1.5, -1.0]
    if with_margin:
        dataset = dataset.add_column("margin", margins)
    trainer = RewardTrainer(
        model=model_path, args=make_args(tmp_path, center_rewards_coefficient=center), train_dataset=dataset
    )
    model = trainer.model.eval()
    rows = [trainer.train_dataset[i] for i in range(4)]
    with torch.no_grad():
        loss = trainer.compute_loss(model, trainer.data_collator(rows))

    expected = 0.0
    for i, row in enumerate(rows):
        r_c = reward_alone(model, row["chosen_ids"]).item()
        r_r = reward_alone(model, row["rejected_ids"]).item()
        m = margins[i] if with_margin else 0.0
        term = torch.log1p(torch.exp(torch.tensor(-(r_c - r_r - m), dtype=torch.float64))).item()  # -log sigmoid
        if center is not None:
            term += center * (r_c + r_r) ** 2
        expected += term / 4
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_margin_shifts_the_loss(tmp_path, model_path):
    """A larger margin demands a larger reward gap: the loss increases, as -log sigmoid(d - m) predicts."""
    base = load_test_dataset("standard_preference", split="train").select(range(2))
    losses = {}
    for m in (0.0, 2.0):
        dataset = base.add_column("margin", [m, m])
        trainer = RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
        trainer.model.eval()
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
        with torch.no_grad():
            losses[m], outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    diff = outputs["rewards_chosen"] - outputs["rewards_rejected"]
    assert losses[2.0] > losses[0.0]
    torch.testing.assert_close(losses[2.0], -F.logsigmoid(diff - 2.0).mean())
    torch.testing.assert_close(losses[0.0], -F.logsigmoid(diff).mean())


def _separable_dataset(n):
    words = [
        "apple",
        "river",
        "stone",
        "cloud",
        "table",
        "music",
        "green",
        "light",
        "paper",
        "horse",
        "seven",
        "night",
    ]
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(n):
        prompt = " ".join(words[(i * k) % len(words)] for k in (1, 3, 5))
        rows["prompt"].append(prompt)
        rows["chosen"].append(" This is correct.")
        rows["rejected"].append(" I don't know.")
    return Dataset.from_dict(rows)


def test_training_raises_accuracy_on_separable_data(tmp_path, model_path):
    dataset = _separable_dataset(16)
    args = make_args(tmp_path, max_steps=15, per_device_train_batch_size=8, learning_rate=3e-3, seed=0)
    trainer = RewardTrainer(model=model_path, args=args, train_dataset=dataset, eval_dataset=dataset)
    # the reward metrics are logged (log_history, which train() starts afresh); evaluate() returns the loss
    trainer.evaluate()
    before = trainer.state.log_history[-1]
    trainer.train()
    trainer.evaluate()
    after = trainer.state.log_history[-1]
    assert after["eval_loss"] < before["eval_loss"]
    assert after["eval_accuracy"] == 1.0 and before["eval_accuracy"] < 1.0
    assert after["eval_margin"] > before["eval_margin"]


def test_compute_metrics_gets_chosen_and_rejected_rewards(tmp_path, model_path):
    """As in TRL: predictions are each batch's chosen rewards then its rejected ones, `(2 * n, 1)`, without labels;
    `predict()` gives the same for a raw dataset."""
    seen = {}

    def compute_metrics(eval_pred):
        seen["predictions"], seen["labels"] = eval_pred.predictions, eval_pred.label_ids
        chosen_then_rejected = eval_pred.predictions[:, 0].reshape(-1, 2, 4)  # batches of 4 pairs
        return {"pairwise_accuracy": float((chosen_then_rejected[:, 0] > chosen_then_rejected[:, 1]).mean())}

    test = load_test_dataset("standard_preference", split="test").select(range(8))
    trainer = RewardTrainer(
        model=model_path,
        args=make_args(tmp_path, per_device_eval_batch_size=4),
        train_dataset=test,
        eval_dataset=test,
        compute_metrics=compute_metrics,
    )
    metrics = trainer.evaluate()
    assert seen["predictions"].shape == (16, 1) and seen["labels"] == ()
    for first in (0, 4):
        batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(first, first + 4)])
        with torch.no_grad():
            scores = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        rows = seen["predictions"][2 * first : 2 * first + 8]
        assert rows == pytest.approx(scores.numpy(), abs=1e-5)  # the batch's chosen rows, then its rejected rows
    logged = trainer.state.log_history[-1]
    assert logged["eval_accuracy"] == pytest.approx(metrics["eval_pairwise_accuracy"])  # two batches of 4 pairs
    predicted = trainer.predict(test.select_columns(["chosen", "rejected"]))  # a raw dataset, prepared first
    assert predicted.predictions == pytest.approx(seen["predictions"], abs=1e-6) and predicted.label_ids == ()


def test_gradient_accumulation_invariance(tmp_path, model_path):
    dataset = load_test_dataset("standard_preference", split="train").select(range(8))
    dataset = dataset.add_column("margin", [0.1 * i for i in range(8)])

    def one_step(out, batch_size, accumulation):
        args = make_args(
            out,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            center_rewards_coefficient=0.1,
            **SGD_STEP_ARGS,
        )
        return sgd_step_update(RewardTrainer(model=model_path, args=args, train_dataset=dataset))

    full = one_step(tmp_path / "a", 8, 1)
    accumulated = one_step(tmp_path / "b", 4, 2)
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], atol=1e-6, rtol=1e-4, msg=name)


# ---------------------------------------------------------------------------------------------------------------------
# Models: loading, pad token, PEFT
# ---------------------------------------------------------------------------------------------------------------------
def test_causal_lm_path_loads_a_sequence_classifier(tmp_path):
    dataset = load_test_dataset("standard_preference", split="train")
    trainer = RewardTrainer(
        model=get_model_path("tiny-LlamaForCausalLM"), args=make_args(tmp_path, max_steps=1), train_dataset=dataset
    )
    assert type(trainer.model).__name__ == "LlamaForSequenceClassification"
    assert trainer.model.config.num_labels == 1
    assert trainer.model.config.pad_token_id == trainer.processing_class.pad_token_id
    assert trainer.train_dataset[0]["chosen_ids"][0] == trainer.processing_class.bos_token_id
    trainer.train()


def test_pad_token_id_is_synced_to_the_model(tmp_path, model_path):
    model = AutoModelForSequenceClassification.from_pretrained(model_path)
    model.config.pad_token_id = None
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.pad_token = None
    dataset = load_test_dataset("standard_preference", split="train")
    trainer = RewardTrainer(
        model=model, args=make_args(tmp_path, max_steps=1), train_dataset=dataset, processing_class=tokenizer
    )
    assert tokenizer.pad_token == tokenizer.eos_token
    assert model.config.pad_token_id == tokenizer.eos_token_id
    trainer.train()


def test_peft_trains_and_saves_the_score_head(tmp_path, model_path):
    from peft import LoraConfig, PeftModel

    dataset = load_test_dataset("standard_preference", split="train")
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = RewardTrainer(
        model=model_path,
        args=make_args(tmp_path, gradient_checkpointing=True),
        train_dataset=dataset,
        peft_config=peft_config,
    )
    assert isinstance(trainer.model, PeftModel)
    assert peft_config.modules_to_save is None  # the user's config is not modified
    trainable = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert any("score" in name for name in trainable) and any("lora_" in name for name in trainable)
    before = snapshot(trainer.model)
    trainer.train()
    changed = changed_params(before, trainer.model, trainable_only=False)
    assert any("score" in name for name in changed)
    assert all("lora_" in name or "score" in name for name in changed)

    adapter_dir = tmp_path / "adapter"
    trainer.save_model(str(adapter_dir))
    assert (adapter_dir / "adapter_config.json").exists()
    base = AutoModelForSequenceClassification.from_pretrained(model_path)
    reloaded = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    trainer.model.eval()
    ids = trainer.train_dataset[0]["chosen_ids"]
    torch.testing.assert_close(reward_alone(reloaded, ids), reward_alone(trainer.model, ids))
    # without the saved head the reward would differ
    fresh = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
    assert not torch.allclose(reward_alone(fresh, ids), reward_alone(trainer.model, ids))


def test_peft_causal_task_type_is_replaced(tmp_path, model_path):
    """The CLI's default --lora_task_type CAUSAL_LM would wrap a generative PEFT model: SEQ_CLS is used instead."""
    from peft import LoraConfig, PeftModelForSequenceClassification

    dataset = load_test_dataset("standard_preference", split="train")
    with pytest.warns(UserWarning, match="SEQ_CLS"):
        trainer = RewardTrainer(
            model=model_path,
            args=make_args(tmp_path, max_steps=1),
            train_dataset=dataset,
            peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"),
        )
    assert isinstance(trainer.model, PeftModelForSequenceClassification)
    assert any("score" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    trainer.train()


def test_peft_model_and_peft_config_conflict(tmp_path, model_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        AutoModelForSequenceClassification.from_pretrained(model_path), LoraConfig(target_modules=["q_proj"])
    )
    dataset = load_test_dataset("standard_preference", split="train")
    with pytest.raises(ValueError, match="PeftModel"):
        RewardTrainer(model=model, args=make_args(tmp_path), train_dataset=dataset, peft_config=LoraConfig())


# ---------------------------------------------------------------------------------------------------------------------
# Files: save, reload, resume; streaming data
# ---------------------------------------------------------------------------------------------------------------------
def test_save_reload_and_resume(tmp_path, model_path):
    dataset = load_test_dataset("standard_preference", split="train")
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, seed=3, data_seed=3)
    full = RewardTrainer(model=model_path, args=make_args(tmp_path / "run", **common), train_dataset=dataset)
    full.train()
    full_losses = [log["loss"] for log in full.state.log_history if "loss" in log]

    card = (tmp_path / "run" / "README.md").read_text()
    assert "Reward Model Card" in card and "reward-trainer" in card
    checkpoint = tmp_path / "run" / "checkpoint-2"
    reloaded = AutoModelForSequenceClassification.from_pretrained(checkpoint)
    assert reloaded.config.num_labels == 1 and reloaded.config.pad_token_id == 4089

    resumed = RewardTrainer(model=model_path, args=make_args(tmp_path / "run", **common), train_dataset=dataset)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed_losses = [log["loss"] for log in resumed.state.log_history if "loss" in log]
    assert len(resumed_losses) == 4
    for a, b in zip(resumed_losses[2:], full_losses[2:]):
        assert abs(a - b) < 1e-5

    final = tmp_path / "final"
    resumed.save_model(str(final))
    model = AutoModelForSequenceClassification.from_pretrained(final)
    trained = dict(resumed.model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, trained[name].detach())


def test_evaluate_prepares_a_raw_dataset(tmp_path, model_path):
    """`evaluate(eval_dataset=...)` with a raw dataset, an IterableDataset or a dict of them gives what the
    constructor's prepared `eval_dataset` gives; an already prepared dataset is left as it is."""
    test = load_test_dataset("standard_preference", split="test").select(range(8))
    test = test.map(lambda _, i: {"margin": 0.25 * (i % 3)}, with_indices=True)
    trainer = RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=test, eval_dataset=test)
    assert trainer._prepare_eval_dataset(trainer.eval_dataset, "eval") is trainer.eval_dataset
    prepared = trainer.evaluate()
    for other in (trainer.evaluate(eval_dataset=test), trainer.evaluate(eval_dataset=test.to_iterable_dataset())):
        for key in ("eval_loss", "eval_accuracy", "eval_margin", "eval_mean_reward"):
            assert other[key] == pytest.approx(prepared[key], abs=1e-6), key
    both = trainer.evaluate(eval_dataset={"first": test.select(range(4)), "second": test.select(range(4, 8))})
    # transformers' prefixes for the loss; the trainer's own metrics keep the "eval_" prefix (as in TRL)
    assert {"eval_first_loss", "eval_second_loss", "eval_accuracy", "eval_margin"} <= set(both)
    assert (both["eval_first_loss"] + both["eval_second_loss"]) / 2 == pytest.approx(prepared["eval_loss"], abs=1e-6)


def test_iterable_dataset(tmp_path, model_path):
    dataset = load_test_dataset("standard_preference", split="train").to_iterable_dataset()
    trainer = RewardTrainer(model=model_path, args=make_args(tmp_path, max_steps=2), train_dataset=dataset)
    assert isinstance(trainer.train_dataset, IterableDataset)
    trainer.train()
    assert trainer.state.global_step == 2


# ---------------------------------------------------------------------------------------------------------------------
# max_length and bad input: clear errors before training
# ---------------------------------------------------------------------------------------------------------------------
def test_max_length_drops_long_pairs_and_logs(tmp_path, model_path, caplog):
    dataset = Dataset.from_dict(
        {"chosen": ["short", "a much longer chosen answer with many words"], "rejected": ["tiny", "x"]}
    )
    with caplog.at_level(logging.WARNING, logger="trl.trainer.reward_trainer"):
        trainer = RewardTrainer(model=model_path, args=make_args(tmp_path, max_length=5), train_dataset=dataset)
    assert len(trainer.train_dataset) == 1
    assert any("Dropped 1 of 2 train pairs" in record.getMessage() for record in caplog.records)
    with pytest.raises(ValueError, match="max_length=1"):
        RewardTrainer(model=model_path, args=make_args(tmp_path, max_length=1), train_dataset=dataset)


def test_missing_chosen_rejected(tmp_path, model_path):
    dataset = load_test_dataset("standard_prompt_completion", split="train")
    with pytest.raises(ValueError, match=r"`chosen` and `rejected`.*|columns \['prompt', 'completion'\]"):
        RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    only_chosen = Dataset.from_dict({"chosen": ["a"], "answer": ["b"]})
    with pytest.raises(ValueError, match=r"columns \['chosen', 'answer'\]"):
        RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=only_chosen)


@pytest.mark.parametrize("margin", [["high", "low"], [1.0, None]])
def test_non_numeric_margin(tmp_path, model_path, margin):
    dataset = Dataset.from_dict({"chosen": ["a", "b"], "rejected": ["c", "d"], "margin": margin})
    with pytest.raises(ValueError, match="margin"):
        RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)


def test_model_with_several_labels(tmp_path, model_path):
    dataset = load_test_dataset("standard_preference", split="train")
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=3, ignore_mismatched_sizes=True)
    with pytest.raises(ValueError, match="num_labels=3"):
        RewardTrainer(model=model, args=make_args(tmp_path), train_dataset=dataset)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardTrainer(
            model=model_path, args=make_args(tmp_path, model_init_kwargs={"num_labels": 2}), train_dataset=dataset
        )


def test_conversational_data_without_chat_template(tmp_path, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = None
    dataset = load_test_dataset("conversational_preference", split="train")
    with pytest.raises(ValueError, match="chat template"):
        RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset, processing_class=tokenizer)


def test_mixed_prompt_and_answer_formats(tmp_path, model_path):
    dataset = Dataset.from_dict(
        {"prompt": ["Hi"], "chosen": [[{"role": "assistant", "content": "Hello"}]], "rejected": [[]]}
    )
    with pytest.raises(ValueError, match="different formats"):
        RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)


def test_other_bad_inputs(tmp_path, model_path):
    dataset = load_test_dataset("standard_preference")
    with pytest.raises(ValueError, match="train_dataset"):
        RewardTrainer(model=model_path, args=make_args(tmp_path))
    with pytest.raises(ValueError, match="DatasetDict"):
        RewardTrainer(model=model_path, args=make_args(tmp_path), train_dataset=dataset)
    with pytest.raises(ValueError, match="empty"):
        RewardTrainer(
            model=model_path, args=make_args(tmp_path), train_dataset=Dataset.from_dict({"chosen": [], "rejected": []})
        )
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        RewardTrainer(model=model_path, args=make_args(tmp_path, eos_token="<nope>"), train_dataset=dataset["train"])
    with pytest.raises(ValueError, match="max_steps"):
        RewardTrainer(
            model=model_path,
            args=make_args(tmp_path, max_steps=-1),
            train_dataset=dataset["train"].to_iterable_dataset(),
        )


@pytest.mark.parametrize("path", ["shared_prefix", "padding_dropped"])
def test_bf16_mixed_precision_reaches_the_paths_past_the_forward(tmp_path, monkeypatch, path):
    """The shared-prefix and padding-dropping paths call the backbone and score head themselves, past the model's
    forward that mixed precision wraps in autocast: they run under the same autocast."""
    from trl.trainer import reward_trainer

    if path == "padding_dropped":
        monkeypatch.setattr(reward_trainer.RewardTrainer, "_shared_prefix_scores", lambda *args: None)
    called = []
    original = reward_trainer.sequence_scores_without_padding

    def spy(*args):
        called.append(original(*args))
        return called[-1]

    monkeypatch.setattr(reward_trainer, "sequence_scores_without_padding", spy)
    args = RewardConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to="none", bf16=True,
        use_cpu=True, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    dataset = load_test_dataset("standard_preference", split="train")
    trainer = RewardTrainer(get_model_path("tiny-Qwen2ForSequenceClassification"), args=args, train_dataset=dataset)
    assert trainer.accelerator.native_amp
    linear_autocast = []
    for module in trainer.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda *_: linear_autocast.append(torch.is_autocast_enabled("cpu")))
    trainer.train()
    assert linear_autocast and all(linear_autocast)
    # Each path really scored the batch (rather than falling back to the model's own, autocast-wrapped forward).
    assert bool(called) == (path == "padding_dropped") and all(scores is not None for scores in called)

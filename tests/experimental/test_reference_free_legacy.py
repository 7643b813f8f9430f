"""TRL's older CPO / ORPO helpers (`build_tokenized_answer`, `concatenated_inputs`, `concatenated_forward`,
`get_batch_loss_metrics`): they agree with the trainers' own fused step and accept both batch layouts."""

import pytest
import torch
from trainer_utils import PREFERENCE_ARGS, args_builder

from trl.assets import load_test_dataset
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer


pytestmark = pytest.mark.usefixtures("single_thread")


def build(kind, tmp_path, model_path, **overrides):
    config, trainer_class = {"cpo": (CPOConfig, CPOTrainer), "orpo": (ORPOConfig, ORPOTrainer)}[kind]
    args = args_builder(config, **PREFERENCE_ARGS)(tmp_path, **overrides)
    data = load_test_dataset("standard_preference", split="train").select(range(4))
    return trainer_class(model_path, args=args, train_dataset=data)


def trl_layout(batch):
    """This project's collated batch rewritten in TRL's `chosen_*` / `rejected_*` layout."""
    n = batch["input_ids"].shape[0] // 2
    labels = batch["input_ids"].masked_fill(~(batch["completion_mask"] * batch["attention_mask"]).bool(), -100)
    out = {}
    for side, rows in (("chosen", slice(0, n)), ("rejected", slice(n, 2 * n))):
        out[f"{side}_input_ids"] = batch["input_ids"][rows]
        out[f"{side}_attention_mask"] = batch["attention_mask"][rows]
        out[f"{side}_labels"] = labels[rows]
    return out


@pytest.mark.parametrize(
    "kind, overrides", [("cpo", {}), ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.0}), ("orpo", {})]
)
def test_get_batch_loss_metrics_equals_the_training_step(tmp_path, model_path, kind, overrides):
    trainer = build(kind, tmp_path, model_path, **overrides)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.model.eval()
    with torch.no_grad():
        step_loss = trainer.compute_loss(trainer.model, batch)
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
        trl_loss, eval_metrics = trainer.get_batch_loss_metrics(trainer.model, trl_layout(batch), train_eval="eval")
    step_metrics = {key: values[-1] for key, values in trainer._metrics["eval"].items()}
    assert loss.item() == pytest.approx(step_loss.item(), rel=1e-5)
    assert trl_loss.item() == pytest.approx(step_loss.item(), rel=1e-5)
    assert list(metrics) == list(step_metrics)
    for key, value in metrics.items():
        assert isinstance(value, float)
        assert value == pytest.approx(step_metrics[key], rel=1e-4, abs=1e-6), key
        assert eval_metrics[f"eval_{key}"] == pytest.approx(value, rel=1e-4, abs=1e-6)


def test_concatenated_forward_shapes(tmp_path, model_path):
    trainer = build("orpo", tmp_path, model_path)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    chosen, rejected, chosen_logits, rejected_logits, nll = trainer.concatenated_forward(trainer.model, batch)
    width, vocab = batch["input_ids"].shape[1], trainer.model.config.vocab_size
    assert chosen.shape == rejected.shape == (2,)
    assert chosen_logits.shape == rejected_logits.shape == (2, width - 1, vocab)  # ORPO drops the last position
    assert nll.dim() == 0 and nll.requires_grad


def test_concatenated_inputs_pads_each_kind_with_its_value():
    batch = {
        "chosen_input_ids": torch.tensor([[1, 2, 3]]),
        "chosen_attention_mask": torch.tensor([[1, 1, 1]]),
        "chosen_labels": torch.tensor([[-100, 2, 3]]),
        "rejected_input_ids": torch.tensor([[1, 4]]),
        "rejected_attention_mask": torch.tensor([[1, 1]]),
        "rejected_labels": torch.tensor([[-100, 4]]),
        "chosen": ["raw text is skipped"],
    }
    out = CPOTrainer.concatenated_inputs(batch, padding_value=9)
    assert sorted(out) == ["concatenated_attention_mask", "concatenated_input_ids", "concatenated_labels"]
    assert out["concatenated_input_ids"].tolist() == [[1, 2, 3], [1, 4, 9]]
    assert out["concatenated_attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out["concatenated_labels"].tolist() == [[-100, 2, 3], [-100, 4, -100]]
    prompt = {"prompt_input_ids": torch.tensor([[5, 6]]), "prompt_attention_mask": torch.tensor([[1, 1]])}
    seq2seq = CPOTrainer.concatenated_inputs(
        {"chosen_labels": torch.tensor([[2]]), "rejected_labels": torch.tensor([[4, 4]]), **prompt},
        is_encoder_decoder=True,
    )
    assert seq2seq["concatenated_labels"].tolist() == [[2, -100], [4, 4]]
    assert seq2seq["concatenated_input_ids"].tolist() == [[5, 6], [5, 6]]


def test_build_tokenized_answer_splits_the_joint_tokenisation(tmp_path, model_path, tokenizer):
    trainer = build("cpo", tmp_path, model_path)
    for prompt, answer in (("The sky is", " blue"), ("hello wor", "ld")):
        out = trainer.build_tokenized_answer(prompt, answer)
        assert out["prompt_input_ids"] + out["input_ids"] == tokenizer(prompt + answer)["input_ids"]
        assert out["attention_mask"] == [1] * len(out["input_ids"])

"""A2POTrainer: the optimal value and the regression loss against hand-written formulas, stage 1 and its filter,
training with TRL's metric keys, save/reload/resume, the default config and bad input."""

import math

import pytest
import torch
from trainer_utils import (
    args_builder,
    assert_saved_model_reloads,
    changed_params,
    resume_from_first_checkpoint,
    snapshot,
    train_logs,
)

from trl.experimental.a2po import A2POConfig, A2POTrainer
from trl.experimental.a2po.a2po_trainer import a2po_loss, first_eos_mask, optimal_value


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(
    A2POConfig,
    max_steps=2,
    per_device_train_batch_size=2,
    max_completion_length=6,
    num_value_samples=4,
    learning_rate=1e-2,
    seed=0,
)
A2PO_METRICS = ["reward", "v_star", "implicit_reward", "advantage"]


def odd_length(prompts, completions, **kwargs):
    return [float(len(text) % 2) for text in completions]


def test_optimal_value_matches_hand_formula():
    rewards = [[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    for beta1 in (0.5, 2.0):
        got = optimal_value(torch.tensor(rewards, dtype=torch.float64), beta1)
        expected = [beta1 * math.log(sum(math.exp(r / beta1) for r in row) / len(row)) for row in rewards]
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))
    # beta1 -> 0 tends to the max, large beta1 to the mean
    assert optimal_value(torch.tensor([[0.0, 1.0]]), 1e-3).item() == pytest.approx(1.0, abs=1e-2)
    assert optimal_value(torch.tensor([[0.0, 1.0]]), 1e3).item() == pytest.approx(0.5, abs=1e-3)


def test_loss_matches_hand_formula():
    logps = torch.tensor([-3.0, -5.5, -1.25], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-3.5, -5.0, -1.0], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    values = torch.tensor([0.6, 0.2, 0.9], dtype=torch.float64)
    loss, implicit, advantages = a2po_loss(logps, ref, rewards, values, beta2=0.1)
    terms = [(0.1 * (a - b) - (r - v)) ** 2 for a, b, r, v in zip(logps.tolist(), ref.tolist(), [1, 0, 1], values)]
    assert loss.item() == pytest.approx(sum(terms) / 3)
    torch.testing.assert_close(implicit, 0.1 * (logps - ref))
    torch.testing.assert_close(advantages, rewards - values)
    loss.backward()
    expected_grad = [2 * 0.1 * (0.1 * (a - b) - (r - v)) / 3 for a, b, r, v in zip(logps, ref, rewards, values)]
    torch.testing.assert_close(logps.grad, torch.stack(expected_grad).detach())


def test_first_eos_mask():
    ids = torch.tensor([[5, 7, 2, 9], [5, 6, 7, 8], [3, 3, 3, 3]])
    assert first_eos_mask(ids, [2, 3]).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_config_defaults_and_default_output_dir(model_path, prompts):
    args = A2POConfig(output_dir="x")
    assert (args.num_value_samples, args.beta1, args.beta2, args.filter_all_incorrect) == (8, 0.5, 0.001, True)
    assert (args.max_prompt_length, args.max_completion_length, args.top_k, args.learning_rate) == (
        512,
        256,
        None,
        5e-5,
    )
    assert args.remove_unused_columns is False
    trainer = A2POTrainer(model=model_path, reward_funcs=odd_length, train_dataset=prompts)
    # TRL keeps the full model id (not only its last path component) in the default output_dir.
    assert trainer.args.output_dir == f"{model_path}-A2PO"
    assert trainer._tag_names == ["trl", "a2po"] and trainer._name == "A2PO"
    assert trainer.processing_class.padding_side == "left"


def test_trains_logs_and_evaluates(tmp_path, model_path, prompts):
    args = make_args(tmp_path, per_device_eval_batch_size=2)
    trainer = A2POTrainer(
        model=model_path,
        reward_funcs=odd_length,
        args=args,
        train_dataset=prompts.select(range(6)),
        eval_dataset=prompts.select([6, 7]),
    )
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    last = train_logs(trainer)[-1]
    for key in A2PO_METRICS:
        assert key in last and math.isfinite(last[key]), key
    assert last["advantage"] == pytest.approx(last["reward"] - last["v_star"], abs=1e-6)
    # Stage 1 covered every prompt; the ones whose 4 samples all scored 0 left the training set.
    assert len(trainer._optimal_values) == 8
    assert len(trainer.train_dataset) <= 6
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    # As in TRL, the A2PO metrics are logged but not added to the dict evaluate() returns.
    logged = trainer.state.log_history[-1]
    assert all(f"eval_{key}" in logged for key in A2PO_METRICS) and "eval_reward" not in metrics
    assert_saved_model_reloads(trainer, tmp_path / "saved")


def test_filter_all_incorrect_drops_unsolved_prompts(tmp_path, model_path, prompts):
    def none_correct(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    args = make_args(tmp_path)
    trainer = A2POTrainer(model=model_path, reward_funcs=none_correct, args=args, train_dataset=prompts.select([0, 1]))
    with pytest.raises(ValueError, match="filter_all_incorrect"):
        trainer.train()
    args = make_args(tmp_path, filter_all_incorrect=False, max_steps=1)
    trainer = A2POTrainer(model=model_path, reward_funcs=none_correct, args=args, train_dataset=prompts.select([0, 1]))
    trainer.train()
    assert len(trainer.train_dataset) == 2
    assert train_logs(trainer)[-1]["v_star"] == 0.0


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1, filter_all_incorrect=False)
    resume_from_first_checkpoint(
        A2POTrainer, args, tmp_path, model=model_path, reward_funcs=odd_length, train_dataset=prompts.select(range(4))
    )


def test_bad_input_is_refused_before_training(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="num_value_samples"):
        make_args(tmp_path, num_value_samples=0)
    with pytest.raises(ValueError, match="beta1"):
        make_args(tmp_path, beta1=0.0)
    with pytest.raises(ValueError, match="reward_weights"):
        A2POTrainer(
            model=model_path,
            reward_funcs=odd_length,
            args=make_args(tmp_path, reward_weights=[1.0, 2.0]),
            train_dataset=prompts,
        )
    with pytest.raises(ValueError, match="prompt"):
        A2POTrainer(
            model=model_path,
            reward_funcs=odd_length,
            args=make_args(tmp_path),
            train_dataset=prompts.rename_column("prompt", "question"),
        )
    with pytest.raises(TypeError, match="reward_funcs"):
        A2POTrainer(model=model_path, reward_funcs=[], args=make_args(tmp_path), train_dataset=prompts)

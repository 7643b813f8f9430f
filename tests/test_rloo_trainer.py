"""RLOOTrainer: leave-one-out advantages, KL in the reward, sequence-level clipped loss, training and resuming."""

import math
import os

import pytest
import torch
from datasets import Dataset
from trainer_utils import (
    GROUP_ARGS,
    ROLLOUT_METRICS,
    args_builder,
    changed_params,
    low_id_reward,
    prefer_token_rewards,
    snapshot,
    train_logs,
)

from trl import RLOOConfig, RLOOTrainer
from trl.assets import get_model_path, load_test_dataset
from trl.trainer.online_base import leave_one_out_advantages
from trl.trainer.rloo_trainer import rloo_sequence_loss
from trl.trainer.utils import split_tensor_dict


MODEL = "tiny-Qwen2ForCausalLM"

RLOO_METRICS = [
    *ROLLOUT_METRICS,
    "rewards/low_id_reward/mean",
    "rewards/low_id_reward/std",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "entropy",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
]


pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(RLOOConfig, **GROUP_ARGS)


# ---------------------------------------------------------------------------------------------------------------------
# Formulas on fixed tensors
# ---------------------------------------------------------------------------------------------------------------------
def test_leave_one_out_advantages_match_formula():
    rewards = [1.0, 2.0, 6.0, 0.0, 4.0, 4.0]
    advantages = leave_one_out_advantages(torch.tensor(rewards), num_generations=3)
    expected = []
    for group in (rewards[:3], rewards[3:]):
        for i, r in enumerate(group):
            others = [v for j, v in enumerate(group) if j != i]
            expected.append(r - sum(others) / len(others))
    torch.testing.assert_close(advantages, torch.tensor(expected))


def test_rloo_sequence_loss_matches_formula():
    logps = torch.tensor([[-1.0, -0.5, -3.0], [-0.2, -0.4, -0.6]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.2, -0.5, -1.0], [-0.1, -0.4, -0.9]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss, ratio = rloo_sequence_loss(
        logps, (old * mask).sum(dim=1), advantages, mask, epsilon_low=0.2, epsilon_high=0.3
    )
    expected_loss, expected_ratio = [], []
    for lp, o, m, a in zip(logps.tolist(), old.tolist(), mask.tolist(), advantages.tolist()):
        r = math.exp(sum((x - y) * k for x, y, k in zip(lp, o, m)))
        expected_ratio.append(r)
        expected_loss.append(-min(r * a, min(max(r, 0.8), 1.3) * a))
    torch.testing.assert_close(ratio, torch.tensor(expected_ratio, dtype=torch.float64))
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=torch.float64))


def test_on_policy_gradient_is_reinforce():
    logps = torch.tensor([[-1.0, -0.5], [-0.2, -0.4]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    advantages = torch.tensor([2.0, -1.0])
    loss, ratio = rloo_sequence_loss(logps, (logps.detach() * mask).sum(dim=1), advantages, mask)
    assert torch.equal(ratio, torch.ones(2))
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, -advantages.unsqueeze(1) * mask)


# ---------------------------------------------------------------------------------------------------------------------
# Advantages inside the trainer: KL in the reward, clipping, normalisation
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer(tmp_path_factory, model_path, prompts):
    args = make_args(tmp_path_factory.mktemp("rloo"), per_device_train_batch_size=8, num_generations=4, beta=0.5)
    trainer = RLOOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    trainer.model.train()
    return trainer


def test_kl_enters_the_reward(trainer):
    rewards = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    batch = {
        "completion_mask": torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]]),
        "old_per_token_logps": torch.tensor([[-1.0, -2.0], [-1.0, -5.0], [-0.5, -0.5], [-3.0, -3.0]]),
        "ref_per_token_logps": torch.tensor([[-2.0, -2.0], [-1.5, -1.0], [-0.5, -1.5], [-1.0, -1.0]]),
    }
    trainer.args.reward_clip_range = (1.5, 3.5)
    trainer._metrics["train"].clear()
    try:
        advantages = trainer._compute_advantages(rewards, batch)
    finally:
        trainer.args.reward_clip_range = None
    # Logged as TRL does: the mean per-token KL over all completion tokens (2.5 over 5 tokens), not per sequence.
    assert trainer._metrics["train"]["kl"] == [pytest.approx(2.5 / 5)]
    kl = [1.0, 0.5, 1.0, 0.0]  # masked sums of old - ref
    clipped = [1.5, 2.0, 3.0, 3.5]
    shaped = [r - 0.5 * k for r, k in zip(clipped, kl)]
    expected = [s - (sum(shaped) - s) / 3 for s in shaped]
    torch.testing.assert_close(advantages, torch.tensor(expected))


def test_zero_std_groups_are_counted_on_kl_shaped_rewards(trainer):
    """As TRL: `frac_reward_zero_std` looks at the rewards the baseline uses (KL penalty included), so equal raw
    rewards with different KLs are not a zero-spread group."""
    rewards = torch.tensor([[1.0], [1.0], [1.0], [1.0]])
    batch = {
        "completion_mask": torch.ones(4, 1),
        "old_per_token_logps": torch.tensor([[-1.0], [-2.0], [-1.0], [-1.0]]),
        "ref_per_token_logps": torch.tensor([[-1.0], [-1.0], [-1.0], [-1.0]]),
    }
    trainer._compute_advantages(rewards, batch)
    shaped = trainer._rewards_for_zero_std(rewards.squeeze(1)).view(-1, 4)
    assert shaped.std(dim=1).item() > 0.0  # one completion's KL differs
    assert shaped.tolist() == [[1.0, 1.5, 1.0, 1.0]]


def test_streaming_train_and_eval_with_workers(tmp_path, model_path, prompts):
    stream = prompts.select(range(6)).to_iterable_dataset(num_shards=2)
    args = make_args(tmp_path, max_steps=4, dataloader_num_workers=2, per_device_eval_batch_size=2)
    trainer = RLOOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=stream, eval_dataset=stream)
    trainer.train()
    assert trainer.state.global_step == 4
    assert "eval_reward" in trainer.evaluate()


def test_normalize_advantages(trainer):
    trainer.args.normalize_advantages = True
    trainer.args.beta = 0.0
    try:
        advantages = trainer._compute_advantages(torch.tensor([[1.0], [2.0], [4.0], [8.0]]), {})
    finally:
        trainer.args.normalize_advantages = False
        trainer.args.beta = 0.5
    assert advantages.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert advantages.std().item() == pytest.approx(1.0, abs=1e-3)


def test_gradient_accumulation_invariance(trainer, prompts):
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([prompts[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)])
    batch["advantages"] = torch.linspace(-1.0, 1.0, 8)
    model = trainer.model

    def gradients(chunks, accumulation):
        model.zero_grad()
        trainer.current_gradient_accumulation_steps = accumulation
        for chunk in chunks:
            # As TRL's RLOO: the Trainer divides the loss by the accumulation steps (loss_is_scaled_for_ga=False).
            (trainer._compute_loss(model, chunk) / accumulation).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full = gradients([batch], 1)
    split = gradients(split_tensor_dict(batch, 2), 2)
    for name, grad in full.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------
def test_train_changes_params_and_logs_every_metric(tmp_path, model_path, prompts):
    args = make_args(tmp_path, epsilon=0.0, epsilon_high=0.0)
    trainer = RLOOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    assert trainer.ref_model is not None  # beta = 0.05 by default
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    logs = train_logs(trainer)
    for key in RLOO_METRICS:
        assert key in logs[-1], key
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-5)
    # on-policy: the importance ratio is exactly 1, so even epsilon = 0 clips nothing
    assert all(log["clip_ratio/region_mean"] == 0.0 for log in logs)


def test_default_config(tmp_path, model_path, prompts, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = RLOOTrainer(model_path, reward_funcs=low_id_reward, train_dataset=prompts)
    args = trainer.args
    assert args.output_dir.endswith(f"{MODEL}-RLOO")
    assert (args.num_generations, args.beta, args.learning_rate, args.normalize_advantages) == (2, 0.05, 1e-6, False)
    assert args.gradient_checkpointing is True and args.remove_unused_columns is False
    trainer.generation_config.max_new_tokens = 8  # keep the test fast; everything else stays at its default
    args.max_steps = 1
    args.report_to = []
    trainer.train()
    assert trainer.state.global_step == 1


def test_num_iterations_uses_stored_old_logps(tmp_path, model_path, prompts):
    args = make_args(tmp_path, beta=0.0, num_iterations=2, epsilon=0.0, epsilon_high=0.0)
    trainer = RLOOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts)
    assert trainer.ref_model is None
    trainer.train()
    assert "old_logps" in trainer._buffered_inputs[0] and "old_per_token_logps" not in trainer._buffered_inputs[0]
    logs = train_logs(trainer)
    assert logs[0]["clip_ratio/region_mean"] == 0.0 and logs[1]["clip_ratio/region_mean"] > 0.0
    assert "kl" not in logs[-1]
    # One ratio per completion: the means are fractions of completions, the extremes over completions (0 or 1).
    assert logs[1]["clip_ratio/high_max"] in (0.0, 1.0) and logs[1]["clip_ratio/low_min"] in (0.0, 1.0)
    assert logs[1]["clip_ratio/region_mean"] * 4 == pytest.approx(round(logs[1]["clip_ratio/region_mean"] * 4))


def test_toy_task_reward_rises(tmp_path, model_path, prompts):
    rewards = prefer_token_rewards(RLOOTrainer, make_args, tmp_path, model_path, prompts, beta=0.0)
    assert rewards[0] < 0.35  # the untrained policy: about a quarter
    assert max(rewards[-2:]) > 0.6


def test_peft_and_reward_model_on_conversational_data(tmp_path, model_path):
    from peft import LoraConfig

    dataset = load_test_dataset("conversational_prompt_only", split="train")
    args = make_args(tmp_path, max_steps=1, reward_weights=[1.0, 0.5])
    trainer = RLOOTrainer(
        model_path,
        reward_funcs=[get_model_path("tiny-Qwen2ForSequenceClassification"), low_id_reward],
        args=args,
        train_dataset=dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.ref_model is None  # the reference is the adapter-disabled policy
    before = snapshot(trainer.model)
    trainer.train()
    changed = changed_params(before, trainer.model)
    assert changed and all("lora" in name for name in changed)
    log = train_logs(trainer)[-1]
    assert "rewards/tiny-Qwen2ForSequenceClassification/mean" in log and "kl" in log


def test_save_and_resume_from_checkpoint(tmp_path, model_path, prompts):
    full = RLOOTrainer(
        model_path,
        reward_funcs=low_id_reward,
        args=make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2),
        train_dataset=prompts,
    )
    full.train()
    checkpoint = os.path.join(tmp_path, "checkpoint-2")
    resumed = RLOOTrainer(
        model_path, reward_funcs=low_id_reward, args=make_args(tmp_path, max_steps=4), train_dataset=prompts
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 4
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, msg=name)


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------------------------------
def test_bad_inputs(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="must have a 'prompt' column"):
        RLOOTrainer(model_path, low_id_reward, args=make_args(tmp_path), train_dataset=Dataset.from_dict({"q": ["a"]}))
    with pytest.raises(ValueError, match="reward_weights has 3 values but there are 1 reward functions"):
        RLOOTrainer(
            model_path, low_id_reward, args=make_args(tmp_path, reward_weights=[1, 2, 3]), train_dataset=prompts
        )
    with pytest.raises(ValueError, match=r"generation_batch_size \(3\) must be divisible by num_generations \(2\)"):
        RLOOConfig(str(tmp_path), per_device_train_batch_size=3)
    with pytest.raises(ValueError, match="reward_clip_range must be a \\(min, max\\) pair"):
        RLOOConfig(str(tmp_path), reward_clip_range=(1.0, -1.0, 2.0))
    with pytest.warns(UserWarning, match="has min > max"):  # TRL trains with it: every reward clipped to max
        RLOOConfig(str(tmp_path), reward_clip_range=(1.0, -1.0))


def test_reward_returning_wrong_count(tmp_path, model_path, prompts):
    trainer = RLOOTrainer(
        model_path,
        reward_funcs=lambda completion_ids, **kw: [0.0] * (len(completion_ids) + 1),
        args=make_args(tmp_path, max_steps=1),
        train_dataset=prompts,
    )
    with pytest.raises(ValueError, match="returned 5 values, but 4 completions were scored"):
        trainer.train()


def test_num_generations_eval_one_and_beam_search(tmp_path, model_path):
    """One completion per prompt has no leave-one-out baseline: advantage 0 (as TRL); beam search generation
    (`num_beams=2, do_sample=False`) trains; `use_vllm` is exposed."""
    assert leave_one_out_advantages(torch.tensor([1.0, 3.0]), 1).tolist() == [0.0, 0.0]
    dataset = load_test_dataset("standard_prompt_only")
    args = make_args(
        tmp_path,
        max_steps=1,
        num_generations_eval=1,
        per_device_eval_batch_size=2,
        generation_kwargs={"num_beams": 2, "do_sample": False},
    )
    trainer = RLOOTrainer(
        model_path,
        reward_funcs=low_id_reward,
        args=args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["test"].select(range(2)),
    )
    assert trainer.use_vllm is False
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == 0.0 and metrics["eval_frac_reward_zero_std"] == 1.0
    trainer.train()
    assert trainer.state.global_step == 1

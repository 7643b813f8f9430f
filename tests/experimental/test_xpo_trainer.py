"""XPOTrainer: the loss, (policy, reference) pairs, the exploration term, alpha schedules, PEFT, resuming and bad
input."""

import math

import pytest
import torch
import torch.nn.functional as F
from trainer_utils import (
    ONLINE_PAIR_ARGS,
    REF_TOKEN,
    ShorterJudge,
    args_builder,
    batch_rows,
    changed_params,
    resume_from_first_checkpoint,
    row_logp,
    single_token_reference,
    snapshot,
    train_logs,
    train_peft_adapters_only,
)
from transformers import AutoModelForCausalLM

from trl.assets import get_model_path
from trl.experimental.online_dpo import OnlineDPOConfig
from trl.experimental.xpo import XPOConfig, XPOTrainer
from trl.experimental.xpo.xpo_trainer import xpo_loss


REWARD_MODEL = "tiny-Qwen2ForSequenceClassification"

pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(XPOConfig, **ONLINE_PAIR_ARGS)


XPO_METRICS = [
    "loss/dpo",
    "loss/xpo",
    "objective/kl",
    "objective/entropy",
    "objective/model_scores",
    "objective/ref_scores",
    "objective/scores_margin",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "val/model_contain_eos_token",
    "val/ref_contain_eos_token",
    "alpha",
    "beta",
]
SCORE_METRICS = ("objective/model_scores", "objective/ref_scores", "objective/scores_margin")


def length_reward(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


# ---------------------------------------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------------------------------------
def test_xpo_loss_matches_formula():
    chosen, rejected = [-3.0, -7.0], [-4.0, -6.5]
    ref_chosen, ref_rejected = [-3.2, -6.0], [-3.9, -6.0]
    ref_samples = [-5.0, -2.0]
    beta, alpha = 0.2, 0.05
    dpo, xpo = xpo_loss(
        *(torch.tensor(v) for v in (chosen, rejected, ref_chosen, ref_rejected, ref_samples)), beta=beta, alpha=alpha
    )
    expected_dpo = [
        math.log(1 + math.exp(-beta * ((c - rc) - (r - rr))))
        for c, r, rc, rr in zip(chosen, rejected, ref_chosen, ref_rejected)
    ]
    torch.testing.assert_close(dpo, torch.tensor(expected_dpo))
    torch.testing.assert_close(xpo, torch.tensor([alpha * v for v in ref_samples]))
    dpo_ipo, _ = xpo_loss(
        *(torch.tensor(v) for v in (chosen, rejected, ref_chosen, ref_rejected, ref_samples)),
        beta=beta,
        alpha=alpha,
        loss_type="ipo",
    )
    expected_ipo = [
        ((c - rc) - (r - rr) - 1 / (2 * beta)) ** 2 for c, r, rc, rr in zip(chosen, rejected, ref_chosen, ref_rejected)
    ]
    torch.testing.assert_close(dpo_ipo, torch.tensor(expected_ipo))


def test_config(tmp_path):
    args = XPOConfig(output_dir=str(tmp_path))
    assert args.alpha == 1e-5 and args.beta == 0.1 and args.learning_rate == 5e-7
    assert XPOConfig(output_dir=str(tmp_path), alpha=[1e-5, 1e-4]).alpha == [1e-5, 1e-4]
    with pytest.raises(ValueError, match="alpha is an empty list"):
        XPOConfig(output_dir=str(tmp_path), alpha=[])


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------
def hand_xpo_loss(policy, reference, scores, alpha=0.1, beta=0.5):
    """XPO's loss over 3 pairs by hand: rows 0-2 are the policy's completions, rows 3-5 the reference's; the pair's
    preferred row by score, DPO on the log-ratio margin plus `alpha` times the reference completions' log-probs."""
    dpo_terms, xpo_terms = [], []
    for i in range(3):
        c, r = (i, i + 3) if scores[i] >= scores[i + 3] else (i + 3, i)
        h = (policy[c] - reference[c]) - (policy[r] - reference[r])
        dpo_terms.append(-F.logsigmoid(beta * h))
        xpo_terms.append(alpha * policy[i + 3])
    return torch.stack(dpo_terms).mean() + torch.stack(xpo_terms).mean()


def test_pairs_are_policy_vs_reference_and_loss_against_plain_forward(tmp_path, model_path, prompts):
    ref_model = single_token_reference(model_path)
    trainer = XPOTrainer(
        model=model_path,
        ref_model=ref_model,
        reward_funcs=length_reward,
        args=make_args(tmp_path, alpha=0.1, beta=0.5),
        train_dataset=prompts,
    )
    batch = trainer._prepare_inputs([prompts[i] for i in range(3)])
    rows = batch_rows(batch)
    for _, completion in rows[3:]:  # the second completion of each pair is the reference's
        assert completion.tolist() == [REF_TOKEN] * 8
    assert any(completion.tolist() != [REF_TOKEN] * 8 for _, completion in rows[:3])
    scores = torch.tensor([float(len(set(c.tolist()))) for _, c in rows])
    torch.testing.assert_close(batch["scores"], scores)
    torch.testing.assert_close(batch["first_win_prob"], (scores[:3] >= scores[3:]).float())

    policy = [row_logp(trainer.model, p, c) for p, c in rows]
    reference = [row_logp(ref_model, p, c) for p, c in rows]
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    torch.testing.assert_close(loss, hand_xpo_loss(policy, reference, scores), atol=1e-4, rtol=1e-4)


def test_train_with_reward_model_logs_every_metric_and_saves(tmp_path, model_path, prompts):
    trainer = XPOTrainer(
        model=model_path,
        reward_funcs=get_model_path(REWARD_MODEL),
        args=make_args(tmp_path),
        train_dataset=prompts,
    )
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    logs = train_logs(trainer)
    for log in logs:
        missing = [m for m in XPO_METRICS if m not in log]
        assert not missing, missing
        assert log["alpha"] == pytest.approx(1e-5) and log["beta"] == pytest.approx(0.1)
        assert log["loss"] == pytest.approx(log["loss/dpo"] + log["loss/xpo"], abs=1e-4)
    assert logs[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)  # the policy starts as the reference
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(p.detach().cpu(), q), name


def test_train_with_judge_and_alpha_schedule(tmp_path, model_path, prompts):
    trainer = XPOTrainer(
        model=model_path,
        judge=ShorterJudge(),
        args=make_args(tmp_path, max_steps=-1, num_train_epochs=2, alpha=[1e-5, 1e-3]),
        train_dataset=prompts.select(range(4)),
    )
    before = snapshot(trainer.model)
    trainer.train()
    assert changed_params(before, trainer.model)
    logs = train_logs(trainer)
    assert [log["alpha"] for log in logs] == pytest.approx([1e-5, 1e-5, 1e-3, 1e-3])
    for log in logs:
        assert all(m in log for m in XPO_METRICS if m not in SCORE_METRICS)
        assert not any(m in log for m in SCORE_METRICS)


def test_peft_reference_is_the_adapter_free_model(tmp_path, model_path, prompts):
    """With LoRA and no `ref_model`, the loss's reference terms are the model with its adapters switched off: after
    training has moved the adapters, the loss equals the formula with those log-probs."""
    args = make_args(tmp_path, alpha=0.1, beta=0.5, learning_rate=0.05)
    trainer, _ = train_peft_adapters_only(
        XPOTrainer, model=model_path, reward_funcs=length_reward, args=args, train_dataset=prompts
    )
    assert all(m in train_logs(trainer)[-1] for m in XPO_METRICS)
    batch = trainer._prepare_inputs([prompts[i] for i in range(3)])
    rows, scores = batch_rows(batch), batch["scores"]
    model = trainer.model
    policy = [row_logp(model, p, c) for p, c in rows]
    with model.disable_adapter():
        reference = [row_logp(model, p, c) for p, c in rows]
    assert max(abs(float(a - b)) for a, b in zip(policy, reference)) > 1e-3  # the adapters moved the policy
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
    torch.testing.assert_close(loss, hand_xpo_loss(policy, reference, scores), atol=1e-4, rtol=1e-4)


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(
        XPOTrainer, args, tmp_path, model=model_path, reward_funcs=length_reward, train_dataset=prompts
    )


# ---------------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------------
def test_bad_input(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="either a judge or reward models"):
        XPOTrainer(
            model=model_path,
            reward_funcs=length_reward,
            judge=ShorterJudge(),
            args=make_args(tmp_path),
            train_dataset=prompts,
        )
    with pytest.raises(TypeError, match="XPOConfig"):
        XPOTrainer(
            model=model_path,
            reward_funcs=length_reward,
            args=OnlineDPOConfig(output_dir=str(tmp_path)),
            train_dataset=prompts,
        )
    with pytest.raises(ValueError, match="needs a way to rank"):
        XPOTrainer(model=model_path, args=make_args(tmp_path), train_dataset=prompts)

"""NashMDTrainer: the loss, the geometric-mixture logits processor, preference probabilities (reward models, hard and
soft judges), mixture_coef schedules, PEFT, resuming and bad input."""

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
    row_token_logps,
    single_token_reference,
    snapshot,
    token_sum_reward,
    train_logs,
    train_peft_adapters_only,
)
from transformers import AutoModelForCausalLM

from trl.assets import get_model_path
from trl.experimental.judges import BasePairwiseJudge
from trl.experimental.nash_md import NashMDConfig, NashMDTrainer
from trl.experimental.nash_md.nash_md_trainer import GeometricMixtureLogitsProcessor, nash_md_loss


REWARD_MODEL = "tiny-Qwen2ForSequenceClassification"

pytestmark = pytest.mark.usefixtures("single_thread")

make_args = args_builder(NashMDConfig, **ONLINE_PAIR_ARGS)


NASH_MD_METRICS = [
    "loss/kl",
    "loss/score",
    "objective/entropy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "rewards/probabilities",
    "logps/chosen",
    "logps/rejected",
    "val/model_contain_eos_token",
    "val/ref_contain_eos_token",
    "mixture_coef",
    "beta",
]
SCORE_METRICS = ("rewards/chosen", "rewards/rejected")


def distinct_reward(completion_ids, **kwargs):
    return [float(len(set(ids))) / 4 for ids in completion_ids]


class PatternJudge(BasePairwiseJudge):
    """Hard verdicts 0, -1, 1 in turn, or, with `return_scores`, fixed probabilities that the first completion wins."""

    probabilities = (0.9, 0.25, 0.6)

    def judge(self, prompts, completions, shuffle_order=True, return_scores=False):
        if return_scores:
            return [self.probabilities[i % 3] for i in range(len(prompts))]
        return [(0, -1, 1)[i % 3] for i in range(len(prompts))]


# ---------------------------------------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------------------------------------
def test_nash_md_loss_values_and_gradient():
    # Two completions of 2 tokens (the second has one padding position).
    token_logps = torch.tensor([[-2.0, -3.0], [-2.0, -7.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.5], [-2.5, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    probability = torch.tensor([0.9, 0.2])
    beta = 0.3
    losses, scores, kl = nash_md_loss(token_logps, ref, mask, probability, beta)
    # by hand: r_t = logp_t - ref_t on real tokens; KL = sum r_t; KL term = sum r_t * logp_t; score = (P - 1/2) * logp
    expected_kl = [-0.5 + -0.5, 0.5]
    expected_scores = [0.4 * -5.0, -0.3 * -2.0]
    kl_terms = [-0.5 * -2.0 + -0.5 * -3.0, 0.5 * -2.0]
    expected = [beta * k - s for k, s in zip(kl_terms, expected_scores)]
    torch.testing.assert_close(kl, torch.tensor(expected_kl))
    torch.testing.assert_close(scores.detach(), torch.tensor(expected_scores))
    torch.testing.assert_close(losses.detach(), torch.tensor(expected))
    losses.sum().backward()
    # d loss / d logp_t = beta * r_t - (P - 1/2): the log-ratio enters as a constant (REINFORCE estimator, per token)
    expected_grad = [[beta * -0.5 - 0.4, beta * -0.5 - 0.4], [beta * 0.5 + 0.3, 0.0]]
    torch.testing.assert_close(token_logps.grad, torch.tensor(expected_grad))


def test_mixture_processor_matches_full_forward_with_left_padding(model_path):
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    reference = AutoModelForCausalLM.from_pretrained(model_path)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.1 * torch.randn_like(param))
    pad_id = 0
    prompt_ids = torch.tensor([[pad_id, pad_id, 11, 12, 13], [21, 22, 23, 24, 25]])
    prompt_mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    coef = 0.3
    processor = GeometricMixtureLogitsProcessor(reference, coef, prompt_mask)
    sequence, mask = prompt_ids, prompt_mask
    for step_tokens in ([7, 8], [9, 10], [3, 4]):
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            policy_scores = policy(input_ids=sequence, attention_mask=mask, position_ids=positions).logits[:, -1]
            ref_scores = reference(input_ids=sequence, attention_mask=mask, position_ids=positions).logits[:, -1]
        mixed = processor(sequence, policy_scores.clone())
        expected = F.log_softmax(coef * ref_scores.log_softmax(-1) + (1 - coef) * policy_scores.log_softmax(-1), -1)
        torch.testing.assert_close(mixed, expected, atol=1e-4, rtol=1e-4)
        sequence = torch.cat([sequence, torch.tensor(step_tokens).unsqueeze(1)], dim=1)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)


def test_mixture_processor_end_points(model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    ids = torch.tensor([[5, 6, 7]])
    mask = torch.ones_like(ids)
    scores = torch.randn(1, model.config.vocab_size)
    scores[0, 3] = -float("inf")  # a token masked for the policy stays masked, without NaN
    with torch.no_grad():
        ref_logps = model(input_ids=ids).logits[:, -1].log_softmax(-1)
    only_policy = GeometricMixtureLogitsProcessor(model, 0.0, mask)(ids, scores.clone())
    torch.testing.assert_close(only_policy, scores.log_softmax(-1))
    only_reference = GeometricMixtureLogitsProcessor(model, 1.0, mask)(ids, scores.clone())
    torch.testing.assert_close(only_reference, ref_logps, atol=1e-5, rtol=1e-5)
    assert not torch.isnan(GeometricMixtureLogitsProcessor(model, 0.5, mask)(ids, scores.clone())).any()


def test_config(tmp_path):
    args = NashMDConfig(output_dir=str(tmp_path))
    assert args.mixture_coef == 0.5 and args.beta == 0.1 and args.learning_rate == 5e-7
    assert NashMDConfig(output_dir=str(tmp_path), mixture_coef=[0.5, 0.2]).mixture_coef == [0.5, 0.2]
    with pytest.raises(ValueError, match=r"lie in \[0, 1\]"):
        NashMDConfig(output_dir=str(tmp_path), mixture_coef=[0.5, 1.5])
    with pytest.raises(ValueError, match="mixture_coef is an empty list"):
        NashMDConfig(output_dir=str(tmp_path), mixture_coef=[])


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------
def test_reward_probabilities_mixture_samples_and_loss_against_plain_forward(tmp_path, model_path, prompts):
    ref_model = single_token_reference(model_path)
    trainer = NashMDTrainer(
        model=model_path,
        ref_model=ref_model,
        reward_funcs=distinct_reward,
        args=make_args(tmp_path, mixture_coef=1.0, beta=0.2),
        train_dataset=prompts,
    )
    batch = trainer._prepare_inputs([prompts[i] for i in range(3)])
    rows = batch_rows(batch)
    for _, completion in rows[3:]:  # mixture_coef=1: the mixture is the reference
        assert completion.tolist() == [REF_TOKEN] * 8
    scores = torch.tensor([len(set(c.tolist())) / 4 for _, c in rows])
    torch.testing.assert_close(batch["scores"], scores)
    probability = torch.sigmoid(scores[:3] - scores[3:])
    torch.testing.assert_close(batch["first_win_prob"], probability)

    policy = [row_token_logps(trainer.model, p, c) for p, c in rows[:3]]
    reference = [row_token_logps(ref_model, p, c) for p, c in rows[:3]]
    # the KL term is token-level: sum_t (log pi - log pi_ref)_t * log pi_t
    kl_terms = torch.stack([((lp - lr) * lp).sum() for lp, lr in zip(policy, reference)])
    sequence_logps = torch.stack([lp.sum() for lp in policy])
    expected = (0.2 * kl_terms - (probability - 0.5) * sequence_logps).mean()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    torch.testing.assert_close(loss, expected, atol=1e-3, rtol=1e-4)


def test_train_with_reward_model_logs_every_metric_and_saves(tmp_path, model_path, prompts):
    trainer = NashMDTrainer(
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
        missing = [m for m in NASH_MD_METRICS if m not in log]
        assert not missing, missing
        assert log["mixture_coef"] == pytest.approx(0.5) and 0.0 <= log["rewards/probabilities"] <= 1.0
        assert log["rewards/margins"] == pytest.approx(log["logps/chosen"] - log["logps/rejected"], abs=1e-3)
    assert logs[0]["loss/kl"] == pytest.approx(0.0, abs=1e-4)
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(p.detach().cpu(), q), name


def test_judges_hard_and_soft(tmp_path, model_path, prompts):
    rows = [prompts[i] for i in range(3)]

    class HardJudge(BasePairwiseJudge):
        def judge(self, prompts, completions, shuffle_order=True):
            return [(0, -1, 1)[i % 3] for i in range(len(prompts))]

    hard = NashMDTrainer(model=model_path, judge=HardJudge(), args=make_args(tmp_path), train_dataset=prompts)
    batch = hard._prepare_inputs(rows)
    torch.testing.assert_close(batch["first_win_prob"], torch.tensor([1.0, float("nan"), 0.0]), equal_nan=True)
    with torch.no_grad():
        assert torch.isfinite(hard.compute_loss(hard.model, batch))  # no verdict: probability 1/2, no NaN

    soft = NashMDTrainer(model=model_path, judge=PatternJudge(), args=make_args(tmp_path), train_dataset=prompts)
    batch = soft._prepare_inputs(rows)
    torch.testing.assert_close(batch["first_win_prob"], torch.tensor(PatternJudge.probabilities))
    before = snapshot(soft.model)
    soft.train()
    assert changed_params(before, soft.model)
    for log in train_logs(soft):
        assert all(m in log for m in NASH_MD_METRICS if m not in SCORE_METRICS)
        assert not any(m in log for m in SCORE_METRICS)


def test_mixture_coef_schedule_with_judge(tmp_path, model_path, prompts):
    trainer = NashMDTrainer(
        model=model_path,
        judge=ShorterJudge(),
        args=make_args(tmp_path, max_steps=-1, num_train_epochs=2, mixture_coef=[0.5, 0.25], beta=[0.1, 0.2]),
        train_dataset=prompts.select(range(4)),
    )
    trainer.train()
    logs = train_logs(trainer)
    assert [log["mixture_coef"] for log in logs] == pytest.approx([0.5, 0.5, 0.25, 0.25])
    assert [log["beta"] for log in logs] == pytest.approx([0.1, 0.1, 0.2, 0.2])


def test_peft_mixture_with_adapter_free_reference(tmp_path, model_path, prompts):
    """With LoRA and no `ref_model`, the KL term's reference is the model with its adapters switched off: after
    training has moved the adapters, the loss equals the formula with those log-probs."""
    args = make_args(tmp_path, beta=0.2, learning_rate=0.05)
    trainer, _ = train_peft_adapters_only(
        NashMDTrainer, model=model_path, reward_funcs=token_sum_reward, args=args, train_dataset=prompts
    )
    assert all(m in train_logs(trainer)[-1] for m in NASH_MD_METRICS)
    batch = trainer._prepare_inputs([prompts[i] for i in range(3)])
    rows, model = batch_rows(batch), trainer.model
    policy = [row_token_logps(model, p, c) for p, c in rows[:3]]
    with model.disable_adapter():
        reference = [row_token_logps(model, p, c) for p, c in rows[:3]]
    assert max(float((lp - lr).abs().max()) for lp, lr in zip(policy, reference)) > 1e-3  # the adapters moved it
    probability = batch["first_win_prob"]
    kl_terms = torch.stack([((lp - lr) * lp).sum() for lp, lr in zip(policy, reference)])
    sequence_logps = torch.stack([lp.sum() for lp in policy])
    expected = (0.2 * kl_terms - (probability - 0.5) * sequence_logps).mean()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
    torch.testing.assert_close(loss, expected, atol=1e-3, rtol=1e-4)


def test_resume_from_checkpoint(tmp_path, model_path, prompts):
    args = make_args(tmp_path, save_strategy="steps", save_steps=1)
    resume_from_first_checkpoint(
        NashMDTrainer, args, tmp_path, abs=1e-4, model=model_path, reward_funcs=distinct_reward, train_dataset=prompts
    )


# ---------------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------------
def test_bad_input(tmp_path, model_path, prompts):
    with pytest.raises(ValueError, match="either a judge or reward models"):
        NashMDTrainer(
            model=model_path,
            reward_funcs=distinct_reward,
            judge=ShorterJudge(),
            args=make_args(tmp_path),
            train_dataset=prompts,
        )

    class OutOfRangeJudge(BasePairwiseJudge):
        def judge(self, prompts, completions, shuffle_order=True, return_scores=False):
            return [1.5] * len(prompts)

    trainer = NashMDTrainer(model=model_path, judge=OutOfRangeJudge(), args=make_args(tmp_path), train_dataset=prompts)
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        trainer.train()

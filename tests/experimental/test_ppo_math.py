"""PPO maths against hand computations on small tensors."""

import math

import pytest
import torch

from trl.experimental.ppo.ppo_math import (
    clipped_policy_loss,
    clipped_value_loss,
    generalized_advantage_estimation,
    masked_var,
    masked_whiten,
    per_token_kl,
    response_masks,
    token_rewards,
)


def test_gae_matches_the_backward_recursion():
    rewards = [[0.0, 0.5, -1.0, 2.0]]
    values = [[0.1, 0.2, 0.3, 0.4]]
    gamma, lam = 0.9, 0.8
    # A_t = delta_t + gamma * lam * A_{t+1}, delta_t = r_t + gamma * V_{t+1} - V_t, V_4 = 0.
    expected, last = [0.0] * 4, 0.0
    for t in reversed(range(4)):
        next_value = values[0][t + 1] if t < 3 else 0.0
        last = rewards[0][t] + gamma * next_value - values[0][t] + gamma * lam * last
        expected[t] = last
    advantages, returns = generalized_advantage_estimation(torch.tensor(rewards), torch.tensor(values), gamma, lam)
    assert advantages[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert returns[0].tolist() == pytest.approx([a + v for a, v in zip(expected, values[0])], abs=1e-6)


def test_gae_lambda_zero_is_one_step_td_and_lambda_one_is_monte_carlo():
    rewards, values = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.5, 0.5, 0.5]])
    td, _ = generalized_advantage_estimation(rewards, values, gamma=1.0, lam=0.0)
    assert td[0].tolist() == pytest.approx([1.0, 2.0, 2.5])
    mc, returns = generalized_advantage_estimation(rewards, values, gamma=1.0, lam=1.0)
    assert returns[0].tolist() == pytest.approx([6.0, 5.0, 3.0])  # reward-to-go


def test_masked_whiten_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    mean, var = 2.0, 1.0  # unbiased variance of (1, 2, 3)
    expected = [(v - mean) / math.sqrt(var + 1e-8) for v in (1.0, 2.0, 3.0)]
    assert masked_whiten(values, mask)[:3].tolist() == pytest.approx(expected, abs=1e-6)
    assert masked_whiten(values, mask, shift_mean=False)[:3].tolist() == pytest.approx(
        [e + mean for e in expected], abs=1e-6
    )
    assert masked_var(values, mask).item() == pytest.approx(1.0)
    single = torch.tensor([True, False, False, False])
    assert math.isnan(masked_var(values, single).item())  # n / (n - 1) with n = 1, as TRL's masked_var
    with pytest.raises(ValueError, match="unmasked"):  # the trainer's whitening refuses it instead of going NaN
        masked_whiten(values, single)


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert per_token_kl(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    r = [-0.5, 1.0]
    assert per_token_kl(logp, ref, "k3").tolist() == pytest.approx([math.exp(x) - 1 - x for x in r])
    assert (per_token_kl(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="k1"):
        per_token_kl(logp, ref, "k2")


def test_token_rewards_put_the_score_after_the_last_token():
    logp = torch.tensor([[-1.0, -1.0, -1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0, -1.0, 1.0], [-1.0, -1.0, -1.0, -3.0]])
    lengths = torch.tensor([1, 3])  # row 0 ends at token 1, row 1 fills the response
    out = token_rewards(torch.tensor([5.0, 7.0]), logp, ref, lengths, kl_coef=0.1)
    assert out.kl.tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]]
    assert out.rewards[0].tolist() == pytest.approx([-0.1, 0.0, 5.0, 0.0])
    assert out.rewards[1].tolist() == pytest.approx([0.0, 0.0, 0.0, 7.0 - 0.2])


def test_response_masks():
    padding, padding_p1 = response_masks(torch.tensor([1, 3]), 4)
    assert padding.tolist() == [[False, False, True, True], [False, False, False, False]]
    assert padding_p1.tolist() == [[False, False, False, True], [False, False, False, False]]


def test_clipped_policy_loss_by_hand():
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    new = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1)]])
    mask = torch.tensor([[True, True, False]])
    out = clipped_policy_loss(adv, new, old, mask, cliprange=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(0.5, 0.8) = 0.8 (clipped); token 2 masked.
    assert out.loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert out.clipfrac.item() == pytest.approx(1.0)
    assert out.ratio[0].tolist() == pytest.approx([1.5, 0.5, 1.1])
    assert out.approxkl.item() == pytest.approx(0.5 * sum(x**2 for x in new[0].tolist()) / 3)


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.0]])
    returns = torch.tensor([[0.0, 1.0]])
    mask = torch.tensor([[True, True]])
    loss, clipfrac = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # token 0: V clipped to 0.7 -> max(1.0, 0.49) = 1.0; token 1: V unchanged -> 1.0.
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    assert clipfrac.item() == pytest.approx(0.0)
    loss, clipfrac = clipped_value_loss(
        torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[True]]), 0.2
    )
    assert loss.item() == pytest.approx(0.5 * 0.8**2) and clipfrac.item() == 1.0

"""The generalized Jensen-Shannon divergence of `trl.trainer.utils.divergence` against a hand-written formula."""

import math

import pytest
import torch

from trl.trainer.utils import generalized_jsd_loss, per_token_generalized_jsd


def hand_probs(logits: torch.Tensor, temperature: float) -> list:
    """Softmax written out: exp of each scaled logit over the sum of them, as nested Python lists."""
    rows = []
    for row in logits.reshape(-1, logits.shape[-1]).tolist():
        exps = [math.exp(z / temperature) for z in row]
        total = sum(exps)
        rows.append([e / total for e in exps])
    return rows


def hand_kl(p: list, q: list) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def hand_token_divergence(student, teacher, beta: float, temperature: float) -> list:
    """Per-position divergence: forward KL at beta 0, reverse KL at 1, the mixture JSD in between."""
    out = []
    for p_s, p_t in zip(hand_probs(student, temperature), hand_probs(teacher, temperature), strict=True):
        if beta == 0:
            out.append(hand_kl(p_t, p_s))
        elif beta == 1:
            out.append(hand_kl(p_s, p_t))
        else:
            mixture = [(1 - beta) * s + beta * t for s, t in zip(p_s, p_t, strict=True)]
            out.append(beta * hand_kl(p_t, mixture) + (1 - beta) * hand_kl(p_s, mixture))
    return out


@pytest.fixture
def logits():
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(2, 5, 7, generator=generator, dtype=torch.float64) * 2
    teacher = torch.randn(2, 5, 7, generator=generator, dtype=torch.float64) * 2
    # Prompt positions (-100 at the start) and padding (-100 at the end) are left out.
    labels = torch.tensor([[-100, -100, 3, 1, 4], [-100, 2, 6, -100, -100]])
    return student, teacher, labels


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.3])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_matches_hand_formula_with_masking(logits, beta, temperature):
    student, teacher, labels = logits
    per_position = hand_token_divergence(student, teacher, beta, temperature)
    kept = [d for d, label in zip(per_position, labels.flatten().tolist(), strict=True) if label != -100]
    n_kept = len(kept)

    def loss(**kwargs):
        return generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature, **kwargs).item()

    assert loss(reduction="sum") == pytest.approx(sum(kept), rel=1e-10)
    assert loss(reduction="batchmean") == pytest.approx(sum(kept) / n_kept, rel=1e-10)
    assert loss(reduction="mean") == pytest.approx(sum(kept) / (n_kept * 7), rel=1e-10)
    assert loss(num_items_in_batch=11) == pytest.approx(sum(kept) / 11, rel=1e-10)
    terms = generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature, reduction="none")
    assert terms.shape == (n_kept, 7)
    torch.testing.assert_close(terms.sum(-1), torch.tensor(kept, dtype=torch.float64))

    # Without labels every position counts; batchmean divides by the batch size.
    assert generalized_jsd_loss(student, teacher, beta=beta, temperature=temperature).item() == pytest.approx(
        sum(per_position) / 2, rel=1e-10
    )
    per_token = per_token_generalized_jsd(student, teacher, labels != -100, beta=beta, temperature=temperature)
    expected = torch.tensor(per_position, dtype=torch.float64).reshape(2, 5) * (labels != -100)
    torch.testing.assert_close(per_token, expected)


def test_beta_endpoints_are_the_two_kl_directions(logits):
    student, teacher, _ = logits
    forward = generalized_jsd_loss(student, teacher, beta=0.0, reduction="sum")
    reverse = generalized_jsd_loss(teacher, student, beta=1.0, reduction="sum")
    torch.testing.assert_close(forward, reverse)
    assert generalized_jsd_loss(student, student.clone(), beta=0.5).item() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_equals_unchunked_values_and_gradients(logits, beta, dtype):
    student, teacher, labels = (t.to(dtype) if t.is_floating_point() else t for t in logits)
    results = []
    for chunk_size in (1, 3, 10_000):
        s = student.clone().requires_grad_(True)
        t = teacher.clone().requires_grad_(True)
        loss = generalized_jsd_loss(s, t, labels, beta=beta, temperature=1.5, chunk_size=chunk_size)
        loss.backward()
        results.append((loss.detach(), s.grad, t.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
def test_gradients_match_autograd_of_the_formula(logits, beta):
    """The custom backward equals autograd through the per-entry terms (reduction "none"), on both sides."""
    student, teacher, labels = logits
    weights = torch.rand(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = []
    for chunked in (True, False):
        s = student.clone().requires_grad_(True)
        t = teacher.clone().requires_grad_(True)
        if chunked:
            value = (per_token_generalized_jsd(s, t, labels != -100, beta=beta, temperature=0.7) * weights).sum()
        else:
            terms = generalized_jsd_loss(s, t, beta=beta, temperature=0.7, reduction="none")
            value = (terms.sum(-1) * weights * (labels != -100)).sum()
        value.backward()
        grads.append((s.grad, t.grad))
        assert torch.isfinite(s.grad).all() and torch.isfinite(t.grad).all()
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0][0][labels == -100].abs().max() == 0  # masked positions get no gradient


def test_gradcheck():
    generator = torch.Generator().manual_seed(2)
    student = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    teacher = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    mask = torch.tensor([[True, False, True], [True, True, False]])
    for beta in (0.0, 0.4, 1.0):
        assert torch.autograd.gradcheck(
            lambda s, t, b=beta: per_token_generalized_jsd(s, t, mask, beta=b, temperature=1.3, chunk_size=2),
            (student, teacher),
        )


def test_hidden_states_with_lm_head_equal_logits_path():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 6, 5, dtype=torch.float64, generator=generator)
    weight = torch.randn(9, 5, dtype=torch.float64, generator=generator)
    bias = torch.randn(9, dtype=torch.float64, generator=generator)
    teacher = torch.randn(2, 6, 9, dtype=torch.float64, generator=generator)
    mask = torch.rand(2, 6, generator=generator) > 0.3
    upstream = torch.rand(2, 6, dtype=torch.float64, generator=generator)

    grads = []
    for from_hidden in (True, False):
        h, w, b = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
        if from_hidden:
            out = per_token_generalized_jsd(
                h, teacher, mask, beta=0.5, lm_head_weight=w, lm_head_bias=b, chunk_size=4, temperature=2.0
            )
        else:
            out = per_token_generalized_jsd(torch.nn.functional.linear(h, w, b), teacher, mask, temperature=2.0)
        (out * upstream).sum().backward()
        grads.append((out.detach(), h.grad, w.grad, b.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_minus_infinity_logits_stay_finite():
    student = torch.tensor([[[0.0, 1.0, -math.inf]]], requires_grad=True)
    teacher = torch.tensor([[[0.5, -math.inf, 0.0]]])
    for beta in (0.0, 0.5, 1.0):
        loss = generalized_jsd_loss(student, teacher, beta=beta)
        loss.backward()
        if beta == 0.5:
            assert torch.isfinite(loss) and torch.isfinite(student.grad).all()
        student.grad = None


def test_bad_arguments_are_rejected(logits):
    student, teacher, labels = logits
    with pytest.raises(ValueError, match="reduction"):
        generalized_jsd_loss(student, teacher, reduction="avg")
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd_loss(student, teacher, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        generalized_jsd_loss(student, teacher, temperature=0)
    with pytest.raises(ValueError, match="vocabulary"):
        generalized_jsd_loss(student, teacher[..., :5])
    with pytest.raises(ValueError, match="chunk_size"):
        generalized_jsd_loss(student, teacher, chunk_size=0)


def test_fully_masked_batch_gives_zero_with_a_graph(logits):
    student, teacher, labels = logits
    s = student.clone().requires_grad_(True)
    loss = generalized_jsd_loss(s, teacher, torch.full_like(labels, -100))
    assert loss.item() == 0.0
    loss.backward()
    assert s.grad.abs().max() == 0


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_frozen_head_divergence_equals_the_plain_path(beta):
    """`frozen_head_generalized_jsd` (gradient computed in the forward) against projecting the hidden states and
    calling `per_token_generalized_jsd`: same values, gradients and entropy; masked rows give 0 and no gradient."""
    from trl.trainer.utils.divergence import frozen_head_generalized_jsd

    torch.manual_seed(5)
    head = torch.nn.Linear(8, 30, dtype=torch.float64).requires_grad_(False)
    with torch.no_grad():
        head.bias[3] = -math.inf  # an entry of probability 0: no NaN in the entropy
    hidden = torch.randn(2, 7, 8, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 7, 30, dtype=torch.float64)
    mask = torch.rand(2, 7) > 0.3
    mask[0, :3] = False
    upstream = torch.randn(2, 7, dtype=torch.float64)
    per_token, entropy = frozen_head_generalized_jsd(hidden, head, teacher, mask, beta=beta, temperature=0.7)
    (grad,) = torch.autograd.grad((per_token * upstream).sum(), hidden)
    logits = head(hidden)
    plain = per_token_generalized_jsd(logits, teacher, mask, beta=beta, temperature=0.7)
    (plain_grad,) = torch.autograd.grad((plain * upstream).sum(), hidden)
    torch.testing.assert_close(per_token, plain)
    torch.testing.assert_close(grad, plain_grad)
    probs = torch.softmax(logits.detach() / 0.7, dim=-1)
    hand_entropy = -(probs * probs.log()).nan_to_num(0.0).sum(-1) * mask
    torch.testing.assert_close(entropy, hand_entropy)
    assert bool(torch.isfinite(entropy).all()) and not bool(grad[~mask].any())


def test_frozen_head_divergence_refuses_a_trainable_head():
    from trl.trainer.utils.divergence import frozen_head_generalized_jsd

    head = torch.nn.Linear(4, 6)
    with pytest.raises(ValueError, match="frozen head"):
        frozen_head_generalized_jsd(torch.randn(2, 4), head, torch.randn(2, 6))

"""Parity cases: knowledge distillation (GKD's generalized Jensen-Shannon divergence)."""

from __future__ import annotations

from . import case


def _jsd_inputs():
    import torch

    generator = torch.Generator().manual_seed(0)
    student = torch.randn(3, 6, 11, generator=generator) * 3
    teacher = torch.randn(3, 6, 11, generator=generator) * 3
    labels = torch.randint(0, 11, (3, 6), generator=generator)
    labels[0, :2] = -100  # prompt
    labels[1, 4:] = -100  # padding
    labels[2, :] = -100
    labels[2, 3] = 5
    return student, teacher, labels


@case("gkd/generalized_jsd_loss")
def gkd_generalized_jsd_loss(ctx) -> dict:
    """The static `GKDTrainer.generalized_jsd_loss` on fixed tensors: every beta regime, two temperatures, every
    reduction, with and without labels and `num_items_in_batch`, plus the student's gradient."""
    from trl.experimental.gkd import GKDTrainer

    student, teacher, labels = _jsd_inputs()
    out = {}
    for beta in (0.0, 0.1, 0.5, 1.0):
        for temperature in (1.0, 2.0):
            for reduction in ("batchmean", "sum", "mean", "none"):
                for name, lab in (("all", None), ("masked", labels)):
                    for num_items in (None, 5):
                        value = GKDTrainer.generalized_jsd_loss(
                            student,
                            teacher,
                            labels=lab,
                            beta=beta,
                            temperature=temperature,
                            reduction=reduction,
                            num_items_in_batch=num_items,
                        )
                        key = f"beta={beta},T={temperature},{reduction},{name},n={num_items}"
                        out[key] = [round(float(v), 9) for v in value.flatten().tolist()]
    for beta in (0.0, 0.5, 1.0):
        s = student.clone().requires_grad_(True)
        GKDTrainer.generalized_jsd_loss(s, teacher, labels=labels, beta=beta, temperature=1.5).backward()
        out[f"grad,beta={beta}"] = [round(float(v), 9) for v in s.grad.flatten().tolist()]
    return out

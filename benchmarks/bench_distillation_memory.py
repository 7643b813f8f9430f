"""Benchmark: the chunked generalized JSD of `DistillationTrainer` versus a naive full-vocabulary implementation.

The naive loss is what a direct transcription of the formula does: float32 `log_softmax` of the student's and of the
teacher's logits for the whole batch, the mixture, both KL terms, then autograd keeps them for the backward pass. The
chunked one (`trl.trainer.utils.divergence.per_token_generalized_jsd`, used by the trainer) processes a bounded
number of positions at a time, forward and backward, so only the two logits tensors (and the student's gradient) are
ever batch-sized. Each measurement runs in a fresh subprocess; "extra peak" is the growth of the peak RSS above what
the inputs already use.

Usage:
    python benchmarks/bench_distillation_memory.py [--batch 4] [--seq 256] [--vocab 32000] [--beta 0.5]
"""

import argparse
import statistics
import time

import _harness


def naive_generalized_jsd(student_logits, teacher_logits, mask, beta: float, temperature: float):
    """Token-mean generalized JSD written out over the full vocabulary (the reference implementation)."""
    import math

    import torch

    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0.0:
        per_token = (log_t.exp() * (log_t - log_s)).sum(-1)
    elif beta == 1.0:
        per_token = (log_s.exp() * (log_s - log_t)).sum(-1)
    else:
        log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
        kl_t = (log_t.exp() * (log_t - log_m)).sum(-1)
        kl_s = (log_s.exp() * (log_s - log_m)).sum(-1)
        per_token = beta * kl_t + (1 - beta) * kl_s
    return (per_token * mask).sum() / mask.sum()


def _run_case(variant: str, mode: str, args: argparse.Namespace) -> dict:
    import torch

    from trl.trainer.utils.divergence import per_token_generalized_jsd

    torch.manual_seed(0)
    shape = (args.batch, args.seq, args.vocab)
    student = torch.randn(shape) * 2
    teacher = torch.randn(shape) * 2
    mask = torch.ones(args.batch, args.seq)
    mask[:, args.seq * 3 // 4 :] = 0  # a quarter of padding
    if mode == "fwd+bwd":
        student.requires_grad_(True)

    def loss_fn():
        if variant == "naive":
            return naive_generalized_jsd(student, teacher, mask, args.beta, args.temperature)
        per_token = per_token_generalized_jsd(
            student, teacher, mask.bool(), beta=args.beta, temperature=args.temperature
        )
        return per_token.sum() / mask.sum()

    def step():
        if mode == "fwd":
            with torch.no_grad():
                return loss_fn().item()
        loss = loss_fn()
        loss.backward()
        student.grad = None
        return loss.item()

    before = _harness.peak_rss_mb(ndigits=None)
    value = step()  # first call: measures the memory peak
    extra = _harness.peak_rss_mb(ndigits=None) - before
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"extra_peak_mib": extra, "time_s": statistics.median(times), "loss": value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._case is not None:  # child process: run one case and print JSON
        variant, mode = args._case.split(":")
        _harness.print_result(_run_case(variant, mode, args))
        return

    logits_mib = args.batch * args.seq * args.vocab * 4 / 2**20
    print(
        f"student and teacher logits: {args.batch} x {args.seq} x {args.vocab} fp32 ({logits_mib:.0f} MiB each), CPU"
    )
    print(f"{'mode':<8} {'variant':<8} {'extra peak MiB':>15} {'time s':>8} {'loss':>10}")
    for mode in args.modes.split(","):
        for variant in ("naive", "chunked"):
            flags = [f"--{key}={getattr(args, key)}" for key in ("batch", "seq", "vocab", "beta", "temperature")]
            flags.append(f"--repeats={args.repeats}")
            result = _harness.run_child(__file__, [*flags, f"--_case={variant}:{mode}"])
            print(
                f"{mode:<8} {variant:<8} {result['extra_peak_mib']:>15.0f} {result['time_s']:>8.3f} "
                f"{result['loss']:>10.6f}"
            )


if __name__ == "__main__":
    main()

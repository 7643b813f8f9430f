"""Benchmark: chunked generalized JSD (`trl.trainer.utils.generalized_jsd_loss`) versus a naive full-vocabulary one.

The naive version builds the float32 log-softmax of both models, the mixture and the per-entry terms for the whole
batch and lets autograd keep them for the backward pass; the chunked one works a block of positions at a time in both
directions. Each measurement runs in a fresh subprocess so that the peak resident memory (`ru_maxrss`) of one variant
is not polluted by another. "Extra peak" is the growth of the peak RSS above what the inputs already use.

Usage:
    python benchmarks/bench_divergence.py [--batch 4] [--seq 512] [--vocab 32000] [--beta 0.5]
"""

import argparse
import math

import _harness


def naive_jsd(student, teacher, labels, beta):
    """Textbook implementation: everything at full vocabulary size for the whole batch."""
    import torch

    log_s = torch.log_softmax(student.float(), dim=-1)
    log_t = torch.log_softmax(teacher.float(), dim=-1)
    log_m = torch.logsumexp(torch.stack([log_s + math.log(1 - beta), log_t + math.log(beta)]), dim=0)
    terms = beta * log_t.exp() * (log_t - log_m) + (1 - beta) * log_s.exp() * (log_s - log_m)
    mask = labels != -100
    return terms.sum(-1)[mask].sum() / mask.sum()


def _run_case(variant: str, mode: str, batch: int, seq: int, vocab: int, beta: float, repeats: int) -> dict:
    import torch

    from trl.trainer.utils import generalized_jsd_loss

    torch.manual_seed(0)
    student = torch.randn(batch, seq, vocab)
    teacher = torch.randn(batch, seq, vocab)
    labels = torch.randint(0, vocab, (batch, seq))
    labels[:, : seq // 4] = -100  # a prompt quarter without loss
    if mode == "fwd+bwd":
        student.requires_grad_(True)

    def fn(s, t, lab):
        if variant == "naive":
            return naive_jsd(s, t, lab, beta)
        return generalized_jsd_loss(s, t, lab, beta=beta)

    def step():
        if mode == "fwd":
            with torch.no_grad():
                return fn(student, teacher, labels)
        fn(student, teacher, labels).backward()
        student.grad = None

    return _harness.extra_peak_and_time(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._case is not None:  # child process: run one case and print JSON
        variant, mode = args._case.split(":")
        _harness.print_result(_run_case(variant, mode, args.batch, args.seq, args.vocab, args.beta, args.repeats))
        return

    logits_mib = args.batch * args.seq * args.vocab * 4 / 2**20
    print(f"student and teacher logits: {args.batch} x {args.seq} x {args.vocab} float32 ({logits_mib:.0f} MiB each)")
    print(f"{'mode':<8} {'variant':<8} {'extra peak MiB':>15} {'time s':>8}")
    for mode in args.modes.split(","):
        for variant in ("naive", "chunked"):
            flags = [f"--{key}={getattr(args, key)}" for key in ("batch", "seq", "vocab", "beta", "repeats")]
            result = _harness.run_child(__file__, [*flags, f"--_case={variant}:{mode}"])
            print(f"{mode:<8} {variant:<8} {result['extra_peak_mib']:>15.0f} {result['time_s']:>8.3f}")


if __name__ == "__main__":
    main()

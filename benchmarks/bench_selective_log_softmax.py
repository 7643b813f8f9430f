"""Benchmark: chunked `selective_log_softmax` versus the naive `log_softmax(...).gather(...)` on CPU.

Each measurement runs in a fresh subprocess so that the peak resident memory (`ru_maxrss`) of one variant is not
polluted by another. "Extra peak" is the growth of the peak RSS above what the inputs already use.

Usage:
    python benchmarks/bench_selective_log_softmax.py [--batch 8] [--seq 512] [--vocab 32000] [--dtype float32]
"""

import argparse

import _harness


def _run_case(variant: str, mode: str, batch: int, seq: int, vocab: int, dtype_name: str, repeats: int) -> dict:
    import torch

    from trl.trainer.utils import selective_log_softmax

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    logits = torch.randn(batch, seq, vocab, dtype=dtype)
    index = torch.randint(0, vocab, (batch, seq))
    if mode == "fwd+bwd":
        logits.requires_grad_(True)

    def naive(x, idx):
        return torch.log_softmax(x.float(), dim=-1).gather(-1, idx.unsqueeze(-1)).squeeze(-1)

    fn = selective_log_softmax if variant == "chunked" else naive

    def step():
        if mode == "fwd":
            with torch.no_grad():
                return fn(logits, index)
        out = fn(logits, index)
        out.sum().backward()
        grad = logits.grad
        logits.grad = None
        return grad

    return _harness.extra_peak_and_time(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._case is not None:  # child process: run one case and print JSON
        variant, mode = args._case.split(":")
        result = _run_case(variant, mode, args.batch, args.seq, args.vocab, args.dtype, args.repeats)
        _harness.print_result(result)
        return

    logits_mib = args.batch * args.seq * args.vocab * (4 if args.dtype == "float32" else 2) / 2**20
    print(f"logits: {args.batch} x {args.seq} x {args.vocab} {args.dtype} ({logits_mib:.0f} MiB), CPU")
    print(f"{'mode':<8} {'variant':<8} {'extra peak MiB':>15} {'time s':>8}")
    for mode in args.modes.split(","):
        for variant in ("naive", "chunked"):
            flags = [f"--{key}={getattr(args, key)}" for key in ("batch", "seq", "vocab", "dtype", "repeats")]
            result = _harness.run_child(__file__, [*flags, f"--_case={variant}:{mode}"])
            print(f"{mode:<8} {variant:<8} {result['extra_peak_mib']:>15.0f} {result['time_s']:>8.3f}")


if __name__ == "__main__":
    main()

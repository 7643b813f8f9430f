"""`x @ Wᵀ` (`F.linear`) against `W @ xᵀ` for the few rows of a decode step, at Qwen2.5-0.5B's weight shapes.

What `trl/trainer/fast_paths/small_row_linear.py` decides on: for each row count, the wall time of one product with
the LM head (151 936 x 896) and with an MLP projection (4 864 x 896, timed over 24 distinct copies so that the weights
come from memory, as in a decode step, not from the cache), fp32 on the CPU.

Usage:
    python benchmarks/bench_small_row_linear.py [--threads 2] [--rows 1,2,3,4,5,6,8,12,16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time


def _milliseconds(function, repeats: int) -> float:
    function()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    head = torch.randn(151936, 896)
    projections = [torch.randn(4864, 896) for _ in range(24)]
    print(f"threads {args.threads}, fp32, ms per product (MLP: per projection)")
    print("| rows | head x @ Wᵀ | head W @ xᵀ | MLP x @ Wᵀ | MLP W @ xᵀ |")
    print("|---|---|---|---|---|")

    def plain(x, weights):
        return [F.linear(x, weight) for weight in weights]

    def weight_on_the_left(x, weights):
        return [torch.mm(weight, x.t()).t().contiguous() for weight in weights]

    for rows in (int(value) for value in args.rows.split(",")):
        x = torch.randn(rows, 896)
        times = [
            _milliseconds(lambda form=form, x=x, weights=weights: form(x, weights), args.repeats) / len(weights)
            for weights in ([head], projections)
            for form in (plain, weight_on_the_left)
        ]
        print(f"| {rows} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.2f} | {times[3]:.2f} |")


if __name__ == "__main__":
    main()

"""The LM head's backward at Qwen2.5-0.5B's head (151 936 x 896, fp32, tied to the input embeddings), isolated.

Times one forward and backward of `embedding -> tanh -> head -> mean label log-prob`, interleaving the variants in one
process and reporting the median CPU seconds of each:
- `plain`: full logits, `log_softmax`, `nn.Embedding`'s dense backward (what an unfused trainer computes);
- `recompute`: the fused, chunked head recomputing each chunk's logits in the backward;
- `ahead`: the fused head with `expected_grad` (gradients computed in the forward, as SFT runs it);
- `ahead+tied`: that, plus the tied-embedding fast path (rows added into the head's gradient in place).

Usage:
    python benchmarks/bench_head_gradients.py --rows 1022 --repeats 3
    python benchmarks/bench_head_gradients.py --rows 82 --repeats 8
"""

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from trl.kernels.linear_log_softmax import linear_selective_log_softmax
from trl.trainer.fast_paths.tied_embedding_grad import _EmbeddingAddingIntoGrad, _grad_accumulator


VOCAB, HIDDEN = 151_936, 896
VARIANTS = ("plain", "recompute", "ahead", "ahead+tied")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1022, help="scored tokens (SFT packed 1 x 1 024: 1 022)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.02)
    ids = torch.randint(0, 2000, (args.rows,))

    def step(variant: str) -> torch.Tensor:
        weight.grad = None
        if variant == "ahead+tied":
            embedded = _EmbeddingAddingIntoGrad.apply(ids, weight, None, _grad_accumulator(weight))
        else:
            embedded = F.embedding(ids, weight)
        hidden = torch.tanh(embedded)
        if variant == "plain":
            logps = torch.log_softmax(F.linear(hidden, weight), -1).gather(-1, ids[:, None]).squeeze(-1)
        else:
            expected = -torch.ones(args.rows) if variant.startswith("ahead") else None
            logps, _, _ = linear_selective_log_softmax(hidden, weight, ids, expected_grad=expected)
        (-logps.mean()).backward()
        return weight.grad

    reference = step("plain").clone()
    for variant in VARIANTS[1:]:
        difference = (step(variant) - reference).abs().max().item()
        print(f"{variant}: largest gradient difference from plain {difference:.2e}")
    times = {variant: [] for variant in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            start = time.process_time()
            step(variant)
            times[variant].append(time.process_time() - start)
    for variant in VARIANTS:
        print(f"{variant:>11}: {statistics.median(times[variant]):.3f} CPU s (median of {args.repeats})")


if __name__ == "__main__":
    main()

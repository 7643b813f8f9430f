"""SFT throughput: padded vs packed vs padding-free batches on a length-skewed dataset.

Each configuration runs in its own subprocess so that peak RSS is measured per configuration.

Usage:
    python benchmarks/bench_sft.py                      # tiny and ~30M models, all three layouts
    python benchmarks/bench_sft.py --models tiny --steps 10

Reports, per model and layout: median step time, real (non-padding) tokens per second, the fraction of computed
positions that were padding, and peak RSS.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


MODELS = {"tiny": "tiny-Qwen2ForCausalLM", "small": "small-Qwen2ForCausalLM"}
LAYOUTS = {
    "padded": {},
    "packed (bfd)": {"packing": True, "packing_strategy": "bfd"},
    "padding-free": {"padding_free": True},
}


def run_one(model_key: str, layout: str, steps: int, batch_size: int, max_length: int) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from trl import SFTConfig, SFTTrainer
    from trl.assets import get_model_path, load_test_dataset

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    dataset = load_test_dataset("length_skewed_language_modeling", split="train")

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    timer = Timer()
    config = SFTConfig(
        output_dir=f"/tmp/bench-sft-{model_key}",
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        max_length=max_length,
        report_to="none",
        save_strategy="no",
        logging_steps=steps,
        gradient_checkpointing=False,
        disable_tqdm=True,
        **LAYOUTS[layout],
    )
    trainer = SFTTrainer(
        model=get_model_path(MODELS[model_key]), args=config, train_dataset=dataset, callbacks=[timer]
    )

    # Count real and computed positions over the batches the run will see.
    real, computed = 0, 0
    loader = trainer.get_train_dataloader()
    for i, batch in enumerate(loader):
        if i >= steps:
            break
        real += int((batch["labels"] != -100).sum()) + batch["input_ids"].shape[0]
        computed += batch["input_ids"].numel()
    trainer.train()
    step_times = timer.times[1:] or timer.times  # first step includes warm-up
    step = statistics.median(step_times)
    return {
        "model": model_key,
        "layout": layout,
        "params_M": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1),
        "step_s": round(step, 4),
        "tokens_per_s": round(real / steps / step, 1),
        "padding_fraction": round(1 - real / computed, 3) if computed else 0.0,
        "peak_rss_MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=1024)
    parser.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._one:
        print(json.dumps(run_one(args._one[0], args._one[1], args.steps, args.batch_size, args.max_length)))
        return

    rows = []
    for model_key in args.models:
        for layout in args.layouts:
            cmd = [sys.executable, __file__, "--_one", model_key, layout, "--steps", str(args.steps)]
            cmd += ["--batch_size", str(args.batch_size), "--max_length", str(args.max_length)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)

    header = "| model | params (M) | layout | step (s) | real tokens/s | padding | peak RSS (MB) |"
    print("\n" + header + "\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params_M']} | {r['layout']} | {r['step_s']} | {r['tokens_per_s']} | "
            f"{r['padding_fraction']:.1%} | {r['peak_rss_MB']} |"
        )


if __name__ == "__main__":
    main()

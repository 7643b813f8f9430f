"""Reward-model (RewardTrainer) and process-reward-model (PRMTrainer) training throughput.

Each configuration runs in its own subprocess so that peak RSS is measured per configuration.

Configurations:
- `reward`: RewardTrainer as shipped (chosen and rejected stacked into one padded batch, one forward pass).
- `reward-2pass`: the same loss computed with two forward passes (chosen, then rejected), for comparison.
- `prm`: PRMTrainer on stepwise supervision.

Usage:
    python benchmarks/bench_reward.py                       # tiny and ~30M models, every configuration
    python benchmarks/bench_reward.py --models tiny --steps 10

Reports, per model and configuration: median step time, examples (pairs or step sequences) per second, real
(non-padding) tokens per second, and peak RSS.
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
CONFIGS = ["reward", "reward-2pass", "prm"]


def run_one(model_key: str, config: str, steps: int, batch_size: int) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    import torch.nn.functional as F
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from trl import RewardConfig, RewardTrainer
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.prm import PRMConfig, PRMTrainer

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    class TwoPassRewardTrainer(RewardTrainer):
        """Same loss, but chosen and rejected go through the model separately (each padded on its own)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            n = ids.shape[0] // 2
            rewards = []
            for rows in (slice(0, n), slice(n, 2 * n)):
                width = int(mask[rows].sum(dim=1).max())
                rewards.append(model(input_ids=ids[rows, :width], attention_mask=mask[rows, :width]).logits[:, 0])
            return -F.logsigmoid(rewards[0] - rewards[1]).mean()

    timer = Timer()
    common = dict(
        output_dir=f"/tmp/bench-reward-{model_key}-{config}",
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        report_to="none",
        save_strategy="no",
        logging_steps=steps,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    model_path = get_model_path(MODELS[model_key])
    if config == "prm":
        dataset = load_test_dataset("standard_stepwise_supervision", split="train")
        trainer = PRMTrainer(model=model_path, args=PRMConfig(**common), train_dataset=dataset, callbacks=[timer])
    else:
        dataset = load_test_dataset("conversational_preference", split="train")
        cls = RewardTrainer if config == "reward" else TwoPassRewardTrainer
        trainer = cls(model=model_path, args=RewardConfig(**common), train_dataset=dataset, callbacks=[timer])

    real = 0
    for i, batch in enumerate(trainer.get_train_dataloader()):
        if i >= steps:
            break
        real += int(batch["attention_mask"].sum())
    trainer.train()
    step = statistics.median(timer.times[1:] or timer.times)  # the first step includes warm-up
    return {
        "model": model_key,
        "config": config,
        "params_M": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1),
        "step_s": round(step, 4),
        "examples_per_s": round(batch_size / step, 1),
        "tokens_per_s": round(real / steps / step, 1),
        "peak_rss_MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._one:
        print(json.dumps(run_one(args._one[0], args._one[1], args.steps, args.batch_size)))
        return

    rows = []
    for model_key in args.models:
        for config in args.configs:
            cmd = [sys.executable, __file__, "--_one", model_key, config, "--steps", str(args.steps)]
            cmd += ["--batch_size", str(args.batch_size)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)

    header = "| model | params (M) | config | step (s) | examples/s | real tokens/s | peak RSS (MB) |"
    print("\n" + header + "\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params_M']} | {r['config']} | {r['step_s']} | {r['examples_per_s']} | "
            f"{r['tokens_per_s']} | {r['peak_rss_MB']} |"
        )


if __name__ == "__main__":
    main()

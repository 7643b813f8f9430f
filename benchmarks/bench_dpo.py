"""DPO step time and peak memory: batch layouts, precomputed reference log-probs, PEFT reference vs full copy.

Each configuration runs in its own subprocess so that peak RSS is measured per configuration. The preference data is
built from the length-skewed test corpus (prompt = start of a text, chosen = its continuation, rejected = the
continuation of another text), so sequence lengths vary a lot inside a batch, as in real preference datasets.

Usage:
    python benchmarks/bench_dpo.py                          # tiny and small models, every configuration
    python benchmarks/bench_dpo.py --models tiny --steps 6 --configs padded packed

Configurations:
    padded          full reference copy, chosen + rejected padded to the longest sequence of the batch
    packed          full reference copy, sequences packed into rows no longer than the longest one (the default
                    layout with eager/SDPA attention)
    padding-free    full reference copy, the whole batch in one row (`padding_free=True`)
    precompute      `precompute_ref_log_probs=True` (no reference model, no reference pass), packed
    peft            LoRA (r=16) policy, reference = adapters disabled (no copy), packed
    peft-padded     the same, padded

Reports, per model and configuration: median step time (first step excluded), the fraction of computed token
positions that are padding, peak RSS, the time spent in the trainer's constructor (tokenization, plus the reference
pre-pass for `precompute`) and the parameter memory of the reference model kept during training.
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
CONFIGS = {
    "padded": {"layout": "padded"},
    "packed": {},
    "padding-free": {"padding_free": True},
    "precompute": {"precompute_ref_log_probs": True},
    "peft": {"peft": True},
    "peft-padded": {"peft": True, "layout": "padded"},
}


def build_dataset(num_pairs: int):
    from datasets import Dataset

    from trl.assets import load_test_dataset

    texts = load_test_dataset("length_skewed_language_modeling", split="train")["text"]
    rows = []
    for i in range(num_pairs):
        words, other = texts[i % len(texts)].split(), texts[(i * 7 + 3) % len(texts)].split()
        cut = max(1, len(words) // 3)
        rows.append(
            {
                "prompt": " ".join(words[:cut]),
                "chosen": " " + " ".join(words[cut:] or ["yes"]),
                "rejected": " " + " ".join(other[len(other) // 3 :] or ["no"]),
            }
        )
    return Dataset.from_list(rows)


def run_one(model_key: str, config_name: str, steps: int, batch_size: int, max_length: int) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from trl import DPOConfig, DPOTrainer
    from trl.assets import get_model_path

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    options = dict(CONFIGS[config_name])
    layout = options.pop("layout", None)
    use_peft = options.pop("peft", False)
    dataset = build_dataset(batch_size * steps)

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    peft_config = None
    if use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    timer = Timer()
    config = DPOConfig(
        output_dir=f"/tmp/bench-dpo-{model_key}",
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        max_length=max_length,
        learning_rate=1e-5,
        report_to="none",
        save_strategy="no",
        logging_steps=steps,
        gradient_checkpointing=False,
        disable_tqdm=True,
        **options,
    )
    start = time.perf_counter()
    trainer = DPOTrainer(
        model=get_model_path(MODELS[model_key]),
        args=config,
        train_dataset=dataset,
        callbacks=[timer],
        peft_config=peft_config,
    )
    init_s = time.perf_counter() - start
    if layout is not None:
        trainer._layout = layout
        trainer._ref_layout = layout if trainer._ref_layout is not None else None

    # Padding share of the computed positions, per layout (the reference pass has the same share).
    real, computed = 0, 0
    for i, batch in enumerate(trainer.get_train_dataloader()):
        if i >= steps:
            break
        lengths = batch["attention_mask"].sum(dim=1)
        real += int(lengths.sum())
        if trainer._layout == "padded":
            computed += batch["input_ids"].numel()
        elif trainer._layout == "padding_free":
            computed += int(lengths.sum())
        else:
            from trl.trainer.utils import pack_padded_sequences

            packed = pack_padded_sequences(batch["input_ids"], batch["attention_mask"], int(lengths.max()))
            computed += packed.input_ids.numel()
    trainer.train()
    step_times = timer.times[1:] or timer.times  # the first step includes warm-up
    ref_params = sum(p.numel() * p.element_size() for p in trainer.ref_model.parameters()) if trainer.ref_model else 0
    return {
        "model": model_key,
        "config": config_name,
        "layout": trainer._layout,
        "params_M": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1),
        "step_s": round(statistics.median(step_times), 4),
        "padding_fraction": round(1 - real / computed, 3) if computed else 0.0,
        "peak_rss_MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "init_s": round(init_s, 2),
        "ref_model_MB": round(ref_params / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._one:
        print(json.dumps(run_one(args._one[0], args._one[1], args.steps, args.batch_size, args.max_length)))
        return

    rows = []
    for model_key in args.models:
        for config_name in args.configs:
            cmd = [sys.executable, __file__, "--_one", model_key, config_name, "--steps", str(args.steps)]
            cmd += ["--batch_size", str(args.batch_size), "--max_length", str(args.max_length)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)

    header = (
        "| model | params (M) | config | layout | step (s) | padding | peak RSS (MB) | init (s) | ref model (MB) |"
    )
    print("\n" + header + "\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params_M']} | {r['config']} | {r['layout']} | {r['step_s']} | "
            f"{r['padding_fraction']:.1%} | {r['peak_rss_MB']} | {r['init_s']} | {r['ref_model_MB']} |"
        )


if __name__ == "__main__":
    main()

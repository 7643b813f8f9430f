"""KTO step time and peak memory: where the KL reference point's extra forward passes go, and what they cost.

KTO scores, besides each example's completion, a "KL" sequence (the example's prompt followed by another example's
completion) under the policy and the reference, to estimate the policy-to-reference KL. This benchmark measures what
that costs in each way of batching it.

Each configuration runs in its own subprocess so that peak RSS is measured per configuration. The unpaired data is
built from the length-skewed test corpus (prompt = start of a text, completion = its continuation or the continuation
of another text, alternating desirable / undesirable), so sequence lengths vary a lot inside a batch.

Usage:
    python benchmarks/bench_kto.py                          # tiny and small models, every configuration
    python benchmarks/bench_kto.py --models small --steps 6 --configs kl-separate kl-batched no-kl
    python benchmarks/bench_kto.py --ab --models small      # interleaved A/B of the KL scheduling, in one process
                                                            # (adds kl-separate-ref-split: reference in 2 passes)

Configurations (all with a full reference copy unless stated):
    trl-like        padded batches; policy: main rows with gradient + KL rows in a second, no-grad forward;
                    reference: main rows and KL rows in two forwards (the layout of TRL's KTO trainer)
    padded          padded batches; policy as above; reference: main + KL rows in ONE forward
    kl-batched      packed (no padding computed); policy: main + KL rows in ONE forward with gradient (the backward
                    pass then also runs over the KL tokens, whose gradient is zero); reference: one packed forward
    kl-separate     packed; policy: main rows with gradient + KL rows in a no-grad forward; reference: main + KL
                    rows in ONE packed forward (the trainer's default)
    no-kl           `loss_type="apo_zero_unpaired"`: no KL rows at all (the floor the KL term is measured against)
    precompute      `precompute_ref_log_probs=True`: reference values (incl. KL) computed once before training
    peft            LoRA (r=16) policy, reference = adapters disabled (no copy), packed, KL as in kl-separate

Reports, per model and configuration: median step time (first step excluded), the share of the step spent on the KL
term (1 - no-kl step / step), peak RSS, the constructor time (tokenization, plus the reference pre-pass for
`precompute`) and the parameter memory of the reference model kept during training.
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
    "trl-like": {"layout": "padded", "kl_in_policy": False, "kl_in_reference": False},
    "padded": {"layout": "padded", "kl_in_policy": False},
    "kl-batched": {"kl_in_policy": True},
    "kl-separate": {"kl_in_policy": False},
    "no-kl": {"loss_type": "apo_zero_unpaired"},
    "precompute": {"precompute_ref_log_probs": True},
    "peft": {"peft": True},
}


def build_dataset(num_examples: int):
    from datasets import Dataset

    from trl.assets import load_test_dataset

    texts = load_test_dataset("length_skewed_language_modeling", split="train")["text"]
    rows = []
    for i in range(num_examples):
        words = texts[i % len(texts)].split()
        cut = max(1, len(words) // 3)
        desirable = i % 2 == 0
        source = words if desirable else texts[(i * 7 + 3) % len(texts)].split()
        completion = source[cut:] if desirable else source[len(source) // 3 :]
        rows.append(
            {
                "prompt": " ".join(words[:cut]),
                "completion": " " + " ".join(completion or ["yes"]),
                "label": desirable,
            }
        )
    return Dataset.from_list(rows)


def run_one(model_key: str, config_name: str, steps: int, batch_size: int, max_length: int) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from trl import KTOConfig, KTOTrainer
    from trl.assets import get_model_path

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    options = dict(CONFIGS[config_name])
    layout = options.pop("layout", None)
    use_peft = options.pop("peft", False)
    kl_in_policy = options.pop("kl_in_policy", None)
    kl_in_reference = options.pop("kl_in_reference", None)
    dataset = build_dataset(batch_size * (steps + 1))

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
    config = KTOConfig(
        output_dir=f"/tmp/bench-kto-{model_key}",
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
    trainer = KTOTrainer(
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
    if kl_in_policy is not None:
        trainer._kl_in_policy_forward = kl_in_policy
    if kl_in_reference is not None:
        trainer._kl_in_reference_forward = kl_in_reference
    trainer.train()
    step_times = timer.times[1:] or timer.times  # the first step includes warm-up
    ref_params = sum(p.numel() * p.element_size() for p in trainer.ref_model.parameters()) if trainer.ref_model else 0
    return {
        "model": model_key,
        "config": config_name,
        "layout": trainer._layout,
        "params_M": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1),
        "step_s": round(statistics.median(step_times), 4),
        "peak_rss_MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "init_s": round(init_s, 2),
        "ref_model_MB": round(ref_params / 2**20, 1),
    }


AB_MODES = {
    # name: (layout override, KL rows in the policy's gradient forward, KL rows in the reference's forward, KL term)
    "trl-like": ("padded", False, False, True),
    "padded": ("padded", False, True, True),
    "kl-batched": (None, True, True, True),
    "kl-separate": (None, False, True, True),
    "kl-separate-ref-split": (None, False, False, True),
    "no-kl": (None, False, True, False),
}


def run_ab(model_key: str, repeats: int, batch_size: int, max_length: int, num_batches: int = 3) -> list[dict]:
    """Interleaved A/B timing of one training step's loss + backward for each way of scheduling the KL passes.

    On a shared machine, runs of separate processes minutes apart see different loads; here every mode runs on the
    same batches, alternating, in one process, and the median per mode is reported.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import random

    import torch
    from transformers.utils import logging as hf_logging

    from trl import KTOConfig, KTOTrainer
    from trl.assets import get_model_path
    from trl.trainer.kto_trainer import _select_rows

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = KTOConfig(
        output_dir=f"/tmp/bench-kto-ab-{model_key}",
        per_device_train_batch_size=batch_size,
        max_length=max_length,
        report_to="none",
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    trainer = KTOTrainer(get_model_path(MODELS[model_key]), args=config, train_dataset=build_dataset(batch_size * 8))
    default_layout = trainer._layout
    batches = []
    for i, batch in enumerate(trainer.get_train_dataloader()):
        if i >= num_batches:
            break
        batches.append(batch)
    n = batch_size
    no_kl_batches = [{**_select_rows(b, 0, n), "label": b["label"]} for b in batches]
    trainer.model.train()
    times: dict[str, list[float]] = {name: [] for name in AB_MODES}
    order = list(AB_MODES)
    rng = random.Random(0)
    for repeat in range(repeats + 1):  # the first round warms up
        rng.shuffle(order)
        for name in order:
            layout, in_policy, in_reference, with_kl = AB_MODES[name]
            trainer._layout = trainer._ref_layout = layout or default_layout
            trainer._kl_in_policy_forward, trainer._kl_in_reference_forward = in_policy, in_reference
            trainer._needs_kl = with_kl
            start = time.perf_counter()
            for batch in batches if with_kl else no_kl_batches:
                trainer.model.zero_grad(set_to_none=True)
                trainer.compute_loss(trainer.model, batch).backward()
            if repeat:
                times[name].append((time.perf_counter() - start) / len(batches))
    floor = statistics.median(times["no-kl"])
    rows = []
    for name in AB_MODES:
        step = statistics.median(times[name])
        rows.append(
            {
                "model": model_key,
                "mode": name,
                "loss+backward_s": round(step, 4),
                "KL share": "-" if name == "no-kl" else f"{1 - floor / step:.0%}",
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument(
        "--ab", action="store_true", help="interleaved in-process timing of the KL scheduling modes (see run_ab)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds of --ab timing")
    parser.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.ab:
        print("| model | mode | loss + backward (s) | KL share |\n|---|---|---|---|")
        for model_key in args.models:
            for row in run_ab(model_key, args.repeats, args.batch_size, args.max_length):
                print(f"| {row['model']} | {row['mode']} | {row['loss+backward_s']} | {row['KL share']} |", flush=True)
        return

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

    floor = {r["model"]: r["step_s"] for r in rows if r["config"] == "no-kl"}
    header = (
        "| model | params (M) | config | layout | step (s) | KL share | peak RSS (MB) | init (s) | ref model (MB) |"
    )
    print("\n" + header + "\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = "-"
        if r["model"] in floor and r["config"] not in ("no-kl", "precompute", "peft"):
            share = f"{1 - floor[r['model']] / r['step_s']:.0%}"
        print(
            f"| {r['model']} | {r['params_M']} | {r['config']} | {r['layout']} | {r['step_s']} | {share} | "
            f"{r['peak_rss_MB']} | {r['init_s']} | {r['ref_model_MB']} |"
        )


if __name__ == "__main__":
    main()

"""Side by side with real TRL 1.16: the same six training jobs, run by this project and by `trl==1.16.0`.

Jobs (same model, data, seed and settings on both sides): SFT with padded batches, SFT packed (`bfd`), DPO, Reward,
KTO, and GRPO generating with transformers `generate`. The model is the ~28M-parameter `small-Qwen2ForCausalLM`
(random weights built offline from its config; `--quick`: the tiny one); the reward model is the same backbone with a
seeded score head, saved once and loaded by both sides.

Every run is a fresh interpreter (peak RSS is its own) started from an empty temporary directory. The TRL side runs
the parity environment's interpreter (`--trl_python`, default `$PARITY_VENV/bin/python`) without `PYTHONPATH`, so it
imports the real `trl`; this project's side runs the interpreter that runs this program, with `PYTHONPATH` set to the
repository. `make bench-compare` runs it from `.venv-bench`, a venv with only this project's own requirements under
the parity venv's pins, so that neither side pays for packages the other does not load (a development environment's
extras, e.g. scipy or boto3, are imported by transformers and accelerate when installed). Runs are interleaved (ours,
TRL, ours, TRL, ...) so that load on a shared machine hits both sides alike; with `--rounds N` each job runs N times
per side and the medians are kept.

Reported per job: CPU time per measured step (process time, all threads), peak RSS, tokens/s (GRPO: completions/s)
from the wall time, MFU (model FLOPs per CPU-second against a `torch.mm` FLOPs per CPU-second measured on the same
threads), and both final losses (they must agree: speed never buys a different number). Ratios are ours / TRL.

Usage:
    make bench-compare                           # .venv-bench/bin/python benchmarks/compare.py
    python benchmarks/compare.py --jobs sft_padded,dpo --steps 6 --rounds 2
    python benchmarks/compare.py --quick         # smoke test: tiny model, 2 steps, every job

Only the standard library is imported at module level (the worker sets the thread count and offline flags first).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = ("sft_padded", "sft_packed", "dpo", "reward", "kto", "grpo")
# Words of the synthetic preference rows; long enough rows that the body of the model, not the overhead, is timed.
_PROMPT_WORDS, _ANSWER_WORDS = 96, 48


# ---------------------------------------------------------------------------------------------------------------------
# Parent: inputs, driving the runs, the table
# ---------------------------------------------------------------------------------------------------------------------


def prepare_inputs(workdir: str, quick: bool) -> dict:
    """Writes the model directories and the datasets (JSON lines) both sides load; returns their paths."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from trl.assets import get_model_path, load_test_dataset

    model_path = get_model_path("tiny-Qwen2ForCausalLM" if quick else "small-Qwen2ForCausalLM")
    reward_path = os.path.join(workdir, "reward_model")
    if not os.path.isdir(reward_path):
        torch.manual_seed(0)
        reward_model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
        reward_model.save_pretrained(reward_path)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(model_path).save_pretrained(reward_path)

    texts = load_test_dataset("length_skewed_language_modeling", split="train")["text"]
    words = [text.split() for text in texts if len(text.split()) >= _PROMPT_WORDS + 2 * _ANSWER_WORDS]
    pairs = []
    for i, row in enumerate(words):
        other = words[(i + 7) % len(words)]
        prompt = " ".join(row[:_PROMPT_WORDS])
        chosen = " " + " ".join(row[_PROMPT_WORDS : _PROMPT_WORDS + _ANSWER_WORDS])
        rejected = " " + " ".join(other[-_ANSWER_WORDS:])
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    unpaired = []
    for i, pair in enumerate(pairs):
        good = i % 2 == 0
        unpaired.append(
            {"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good}
        )
    prompts = [{"prompt": " ".join(row[:48])} for row in words]
    datasets = {"text": [{"text": t} for t in texts], "preference": pairs, "unpaired": unpaired, "prompts": prompts}
    paths = {"model": model_path, "reward_model": reward_path}
    for name, rows in datasets.items():
        path = os.path.join(workdir, f"{name}.jsonl")
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        paths[name] = path
    return paths


def run_worker(side: str, job: str, args: argparse.Namespace, paths: dict, python: str) -> dict:
    """Runs one job in a fresh interpreter of `side` ("ours" or "trl") and returns the JSON line it printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    if side == "ours":
        env["PYTHONPATH"] = REPO
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["MKL_NUM_THREADS"] = str(args.threads)
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    spec = {"job": job, "side": side, "steps": args.steps, "warmup": args.warmup, "threads": args.threads}
    spec.update({"quick": args.quick, "max_length": args.max_length, "paths": paths})
    with tempfile.TemporaryDirectory(prefix=f"bench-compare-{side}-") as cwd:
        spec["output_dir"] = os.path.join(cwd, "out")
        proc = subprocess.run(
            [python, os.path.abspath(__file__), "--_worker", json.dumps(spec)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{side} {job} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(lines[-1])


def measure_matmul_peak(threads: int) -> float:
    """fp32 `torch.mm` FLOPs per CPU-second on `threads` threads (in a child, so the thread count is its own)."""
    code = (
        "import time, torch\n"
        f"torch.set_num_threads({threads})\n"
        "a = torch.randn(1024, 1024); b = torch.randn(1024, 1024)\n"
        "for _ in range(3): a @ b\n"
        "best = 0.0\n"
        "for _ in range(5):\n"
        "    t = time.process_time()\n"
        "    for _ in range(8): a @ b\n"
        "    best = max(best, 8 * 2 * 1024**3 / (time.process_time() - t))\n"
        "print(best)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def flops_per_token(model_path: str, seq_len: int) -> float:
    from transformers import AutoConfig

    from trl.trainer.utils.flops import compute_flops_per_token

    return compute_flops_per_token(AutoConfig.from_pretrained(model_path), max(seq_len, 1))


def summarise(job: str, ours: list[dict], trl: list[dict], peak: float, paths: dict) -> dict:
    def med(rows: list[dict], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    row = {"job": job}
    # The job's real tokens per step, counted on TRL's side (ours may lay the same tokens out differently).
    tokens, seq_len, items = trl[-1]["tokens_per_step"], trl[-1]["seq_len"], trl[-1]["items_per_step"]
    for side, rows in (("ours", ours), ("trl", trl)):
        row[f"{side}_cpu_s"] = med(rows, "cpu_s")
        row[f"{side}_wall_s"] = med(rows, "wall_s")
        row[f"{side}_rss_mb"] = med(rows, "peak_rss_mb")
        row[f"{side}_loss"] = rows[-1]["final_loss"]
        row[f"{side}_rate"] = items / row[f"{side}_wall_s"]
        flops = flops_per_token(paths["model"], seq_len) * tokens
        row[f"{side}_mfu"] = flops / row[f"{side}_cpu_s"] / peak
    row["unit"] = ours[-1]["unit"]
    row["cpu_ratio"] = row["ours_cpu_s"] / row["trl_cpu_s"]
    row["rss_ratio"] = row["ours_rss_mb"] / row["trl_rss_mb"]
    row["rate_ratio"] = row["ours_rate"] / row["trl_rate"]
    scale = max(abs(row["trl_loss"]), 1e-3)
    row["loss_agrees"] = abs(row["ours_loss"] - row["trl_loss"]) <= 1e-3 * scale + 1e-5
    return row


def print_table(rows: list[dict]) -> None:
    head = (
        "| job | CPU s/step ours / TRL | ratio | peak RSS MB ours / TRL | ratio | rate ours / TRL | ratio "
        "| MFU ours / TRL | final loss ours / TRL |"
    )
    print(head)
    print("|" + "---|" * 9)
    for r in rows:
        loss = f"{r['ours_loss']:.6g} / {r['trl_loss']:.6g}" + ("" if r["loss_agrees"] else " (DIFFER)")
        print(
            f"| {r['job']} | {r['ours_cpu_s']:.3f} / {r['trl_cpu_s']:.3f} | {r['cpu_ratio']:.2f} "
            f"| {r['ours_rss_mb']:.0f} / {r['trl_rss_mb']:.0f} | {r['rss_ratio']:.2f} "
            f"| {r['ours_rate']:.1f} / {r['trl_rate']:.1f} {r['unit']} | {r['rate_ratio']:.2f} "
            f"| {100 * r['ours_mfu']:.0f} % / {100 * r['trl_mfu']:.0f} % | {loss} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated subset of {', '.join(JOBS)}")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per run (after the warm-up ones)")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before the measured ones")
    parser.add_argument("--rounds", type=int, default=1, help="runs per job and side, interleaved")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps: a smoke test of the program")
    parser.add_argument("--trl_python", default=None, help="interpreter with trl==1.16.0 (default: the parity venv)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    if args._worker:
        worker(json.loads(args._worker))
        return 0
    if args.quick:
        args.steps, args.warmup, args.max_length = 2, 1, 256
    jobs = [job.strip() for job in args.jobs.split(",") if job.strip()]
    unknown = sorted(set(jobs) - set(JOBS))
    if unknown:
        parser.error(f"unknown jobs {unknown}; choose from {', '.join(JOBS)}")
    venv = os.environ.get("PARITY_VENV", "/work/main/.venv-parity")
    trl_python = args.trl_python or os.path.join(venv, "bin", "python")
    if not os.path.exists(trl_python):
        parser.error(f"no TRL 1.16 interpreter at {trl_python}: build it with `make parity-env` or pass --trl_python")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as workdir:
        paths = prepare_inputs(workdir, args.quick)
        peak = measure_matmul_peak(args.threads)
        print(f"matmul peak: {peak / 1e9:.1f} GFLOP per CPU-second ({args.threads} threads)", flush=True)
        print(f"ours: {sys.executable}\ntrl:  {trl_python}", flush=True)
        for job in jobs:
            results = {"ours": [], "trl": []}
            for _ in range(args.rounds):
                for side, python in (("ours", sys.executable), ("trl", trl_python)):
                    result = run_worker(side, job, args, paths, python)
                    print(json.dumps(result), flush=True)
                    results[side].append(result)
            rows.append(summarise(job, results["ours"], results["trl"], peak, paths))
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(row["loss_agrees"] for row in rows) else 1


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one job on one side (runs under either interpreter; imports `trl` from wherever the side's path points)
# ---------------------------------------------------------------------------------------------------------------------


def cheap_reward(completion_ids, **kwargs):
    """Share of low token ids in the completion: costs next to nothing, so scoring does not dominate GRPO."""
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def worker(spec: dict) -> None:
    threads = spec["threads"]
    import torch

    torch.set_num_threads(threads)
    from datasets import load_dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    import trl

    hf_logging.set_verbosity_error()
    job, paths, max_length = spec["job"], spec["paths"], spec["max_length"]
    total_steps = spec["warmup"] + spec["steps"]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.cpu, self.wall = [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self._cpu, self._wall = time.process_time(), time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.cpu.append(time.process_time() - self._cpu)
            self.wall.append(time.perf_counter() - self._wall)

    def data(name: str):
        return load_dataset("json", data_files=paths[name], split="train")

    common = {
        "output_dir": spec["output_dir"],
        "max_steps": total_steps,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "bf16": False,  # TRL's configs default to bf16, which a CPU-only machine refuses
    }
    clock = StepClock()
    batch = 8
    unit = "tokens/s"
    if job in ("sft_padded", "sft_packed"):
        packing = {"packing": True, "packing_strategy": "bfd"} if job == "sft_packed" else {}
        config = trl.SFTConfig(**common, per_device_train_batch_size=batch, max_length=max_length, **packing)
        trainer = trl.SFTTrainer(paths["model"], args=config, train_dataset=data("text"), callbacks=[clock])
    elif job == "dpo":
        batch = 4
        config = trl.DPOConfig(**common, per_device_train_batch_size=batch, max_length=max_length)
        trainer = trl.DPOTrainer(paths["model"], args=config, train_dataset=data("preference"), callbacks=[clock])
    elif job == "reward":
        config = trl.RewardConfig(**common, per_device_train_batch_size=batch, max_length=max_length)
        dataset = data("preference")
        trainer = trl.RewardTrainer(paths["reward_model"], args=config, train_dataset=dataset, callbacks=[clock])
    elif job == "kto":
        config = trl.KTOConfig(**common, per_device_train_batch_size=batch, max_length=max_length)
        trainer = trl.KTOTrainer(paths["model"], args=config, train_dataset=data("unpaired"), callbacks=[clock])
    elif job == "grpo":
        unit = "completions/s"
        config = trl.GRPOConfig(
            **common,
            per_device_train_batch_size=batch,
            num_generations=4,
            max_completion_length=16 if spec["quick"] else 32,
        )
        trainer = trl.GRPOTrainer(
            paths["model"], reward_funcs=cheap_reward, args=config, train_dataset=data("prompts"), callbacks=[clock]
        )
    else:
        raise ValueError(f"unknown job {job!r}")

    counter = _TokenCounter(trainer, job)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    measured = slice(spec["warmup"], None)
    tokens_per_step, seq_len = counter.per_step(spec["warmup"])
    result = {
        "job": job,
        "side": spec["side"],
        "trl_file": os.path.dirname(trl.__file__),
        "cpu_s": statistics.median(clock.cpu[measured]),
        "wall_s": statistics.median(clock.wall[measured]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_loss": losses[-1],
        "tokens_per_step": tokens_per_step,
        "seq_len": seq_len,
        "items_per_step": batch * 1.0 if job == "grpo" else tokens_per_step,
        "unit": unit,
    }
    print(json.dumps(result), flush=True)


class _TokenCounter:
    """Counts the real (non-padding) tokens a job trains on per step by watching the model's forward inputs.

    Both sides count the same way: the attention mask (or, packed, the number of positions) of each call of the
    trained model's forward with gradients enabled; generation and reference passes run without gradients.
    """

    def __init__(self, trainer, job: str):
        import torch

        self.tokens: list[int] = []
        self.lengths: list[int] = []
        self.trainer = trainer
        self.current = 0

        def hook(module, args, kwargs):
            if not torch.is_grad_enabled():
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            if ids is None:
                return
            if mask is not None and mask.dim() == 4:
                # A shared-prefix layout's additive mask: padding attends only to itself and nothing attends to it.
                sees = mask[:, 0] == 0
                others = sees & ~torch.eye(sees.shape[-1], dtype=torch.bool, device=sees.device)
                real = int((others.any(dim=-1) | others.any(dim=-2)).sum())
            else:
                real = int(mask.sum()) if mask is not None else ids.numel()
            self.current += real
            self.lengths.append(ids.shape[-1])

        trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
        self._install_step_boundary()

    def _install_step_boundary(self):
        from transformers import TrainerCallback

        counter = self

        class Boundary(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                counter.tokens.append(counter.current)
                counter.current = 0

        self.trainer.add_callback(Boundary())

    def per_step(self, warmup: int) -> tuple[float, int]:
        tokens = self.tokens[warmup:] or self.tokens
        return statistics.mean(tokens), int(statistics.mean(self.lengths)) if self.lengths else 1


if __name__ == "__main__":
    sys.exit(main())

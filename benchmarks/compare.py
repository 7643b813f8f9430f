"""Side by side with real TRL 1.16: the same six training jobs, run by this project and by `trl==1.16.0`.

Jobs (same model, data, seed and settings on both sides): SFT with padded batches, SFT packed (`bfd`), DPO, Reward,
KTO, and GRPO generating with transformers `generate`. Two shapes:

- `--shape small` (default): the ~28M-parameter `small-Qwen2ForCausalLM` (`--quick`: the tiny one), batches of 8
  (DPO 4) at `--max_length`, GRPO 2 prompts of ~70 tokens x 4 completions of 32 tokens. A fast regression guard.
- `--shape qwen2.5-0.5b`: a model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 key-value heads,
  intermediate 4 864, vocabulary 151 936, tied embeddings) with random weights, built offline from a config and saved
  once under `$TRL_BENCH_CACHE` (default `~/.cache/trl/bench`); the tiny model's tokenizer, whose ids use the low
  range of the 151 936-row head. SFT padded 2 x 512, SFT packed 1 x 1 024, DPO 1 x 512, Reward 2 x 512, KTO 2 x 512,
  GRPO 2 prompts of 256 tokens x 4 completions of 32 tokens. `--layers N` keeps the width with fewer layers (a smoke
  test). fp32 on a CPU; on a GPU, bf16 weights with SDPA attention (either shape).

Named in `--jobs`, more trainers run on the same data: RLOO and GMPO (as GRPO), on-policy distillation and GKD (a
teacher of the same shape), Online DPO (two completions per prompt), ORPO, CPO and TPO (DPO's pairs), BCO (KTO's
unpaired rows), and DPO whose reference follows a BEMA of the policy (`bema_dpo`, refreshed every step). `--lora R`
trains LoRA adapters of rank R on every linear layer instead of the whole model, on both sides (`peft_config`).

The reward model is the same backbone with a seeded score head, saved once and loaded by both sides. Every run is a
fresh interpreter (peak RSS is its own) started from an empty temporary directory. The TRL side runs the parity
environment's interpreter (`--trl_python`, default `$PARITY_VENV/bin/python`; for BCO, which TRL 1.16 dropped,
`$PARITY_VENV_112/bin/python` with trl 1.12) without `PYTHONPATH`, so it imports the real `trl`; this project's side
runs the interpreter that runs this program, with `PYTHONPATH` set to the repository.
`make bench-compare` runs it from `.venv-bench`, a venv with only this project's own requirements under the parity
venv's pins, so that neither side pays for packages the other does not load. Runs are interleaved (ours, TRL, ours,
TRL, ...) so that load on a shared machine hits both sides alike; with `--rounds N` each job runs N times per side and
the medians are kept.

Reported per job: CPU time per measured step (process time, all threads), peak RSS, the peak of live tensor memory
(on a GPU `torch.cuda.max_memory_allocated`; on a CPU the tensors alive when one extra, untimed step starts plus the
most the CPU allocator held on top of them during that step, from `torch.profiler`'s memory events), tokens/s (GRPO:
completions/s) from the wall time, MFU (CPU only: model FLOPs per CPU-second against a `torch.mm` FLOPs per
CPU-second measured on the same threads), and both final losses (they must agree: speed never buys a different
number). Ratios are ours / TRL.

Usage:
    make bench-compare                           # .venv-bench/bin/python benchmarks/compare.py
    make bench-compare-realistic                 # ... benchmarks/compare.py --shape qwen2.5-0.5b
    python benchmarks/compare.py --jobs sft_padded,dpo --steps 6 --rounds 2
    python benchmarks/compare.py --quick         # smoke test: tiny model, 2 steps, every job
    python benchmarks/compare.py --shape qwen2.5-0.5b --layers 2 --steps 1 --warmup 0   # smoke test of that shape
    python benchmarks/compare.py --jobs rloo,gkd,online_dpo,tpo   # jobs beyond the default six
    python benchmarks/compare.py --jobs dpo --rows 1 --ablate reference_cache   # later epochs, with and without the cache
    python benchmarks/compare.py --jobs reward --config gradient_checkpointing=false --ablate lean_modules
    python benchmarks/compare.py --shape qwen2.5-0.5b --layers 2 --lora 16 --jobs sft_packed,distillation

Only the standard library is imported at module level (the worker sets the thread count and offline flags first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = ("sft_padded", "sft_packed", "dpo", "reward", "kto", "grpo")
# Jobs run only when named in `--jobs`: the same data and sizes through other trainers.
EXTRA_JOBS = (
    "rloo",
    "distillation",
    "orpo",
    "cpo",
    "gkd",
    "online_dpo",
    "tpo",
    "gmpo",
    "gold",
    "iw_opd",
    "sdft",
    "sdpo",
    "a2po",
    "bema_dpo",
    "bco",
)
# Jobs whose trainer TRL 1.16 dropped: their TRL side runs the last release that had it (`make parity-env-112`).
OLDER_TRL_JOBS = {"bco": ("PARITY_VENV_112", "/work/main/.venv-parity-112", "1.12")}
SHAPES = ("small", "qwen2.5-0.5b")
# Qwen2.5-0.5B's architecture (its config.json, less the tokenizer's ids, which come from the tiny tokenizer).
QWEN25_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
# Per job at the realistic shape: per-device batch size and max_length (GRPO: 8 completions, 2 prompts x 4).
REALISTIC_JOBS = {
    "sft_padded": (2, 512),
    "sft_packed": (1, 1024),
    "dpo": (1, 512),
    "reward": (2, 512),
    "kto": (2, 512),
    "grpo": (8, 512),
    "rloo": (8, 512),
    "distillation": (2, 512),
    "orpo": (1, 512),
    "cpo": (1, 512),
    "gkd": (2, 512),
    "online_dpo": (2, 512),
    "tpo": (1, 512),
    "gmpo": (8, 512),
    "gold": (2, 512),
    "iw_opd": (2, 512),
    "sdft": (8, 512),
    "sdpo": (8, 512),
    "a2po": (2, 512),
    "bema_dpo": (1, 512),
    "bco": (2, 512),
}
# Words of the synthetic preference rows per shape: prompt, answer. Long enough that the body of the model, not the
# overhead, is timed (~1.6 tokens a word); the realistic rows are ~400 tokens, ~300 of them the shared prompt.
_ROW_WORDS = {"small": (96, 48), "qwen2.5-0.5b": (192, 64)}
GRPO_PROMPT_TOKENS = 256  # the realistic shape's GRPO prompts (the small shape's: 48 words)


# ---------------------------------------------------------------------------------------------------------------------
# Parent: inputs, driving the runs, the table
# ---------------------------------------------------------------------------------------------------------------------


def realistic_models(layers: int) -> tuple[str, str]:
    """Builds (once) the Qwen2.5-0.5B-shaped model and its reward model; returns both directories.

    Random weights (seed 0) from `QWEN25_05B` with `layers` decoder layers, the tiny test model's tokenizer, saved
    under `$TRL_BENCH_CACHE` (default `~/.cache/trl/bench`) and reused by later runs.

    Args:
        layers (`int`):
            Number of decoder layers (24 is the real shape; fewer keep the width for a smoke test).

    Returns:
        `tuple[str, str]`: the causal LM's directory and the reward model's (the same backbone, a seeded score head).
    """
    cache = os.environ.get("TRL_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "trl", "bench"))
    name = "qwen2.5-0.5b" if layers == QWEN25_05B["num_hidden_layers"] else f"qwen2.5-0.5b-{layers}layers"
    path, reward_path = os.path.join(cache, name), os.path.join(cache, name + "-reward")
    if os.path.exists(os.path.join(reward_path, "config.json")):
        return path, reward_path
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from trl.assets import get_model_path

    tokenizer = AutoTokenizer.from_pretrained(get_model_path("tiny-Qwen2ForCausalLM"))
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    config = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers}, **ids)
    for target, build in (
        (path, lambda: Qwen2ForCausalLM(config)),
        (reward_path, lambda: AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)),
    ):
        partial = target + f".partial-{os.getpid()}"  # renamed into place when complete
        torch.manual_seed(0)
        build().save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
    return path, reward_path


def prepare_inputs(workdir: str, quick: bool, shape: str = "small", layers: int | None = None) -> dict:
    """Writes the datasets (JSON lines) both sides load, and the models they need; returns their paths.

    Args:
        workdir (`str`):
            Where to write the datasets (and the small shape's reward model).
        quick (`bool`):
            The small shape with the tiny model instead.
        shape (`str`, *optional*, defaults to `"small"`):
            One of `SHAPES`.
        layers (`int` or `None`, *optional*, defaults to `None`):
            Decoder layers of the realistic shape (`None`: its 24).
    """
    import _harness
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trl.assets import get_model_path

    if shape == "small":
        model_path = get_model_path("tiny-Qwen2ForCausalLM" if quick else "small-Qwen2ForCausalLM")
        reward_path = os.path.join(workdir, "reward_model")
        if not os.path.isdir(reward_path):
            torch.manual_seed(0)
            AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1).save_pretrained(reward_path)
            AutoTokenizer.from_pretrained(model_path).save_pretrained(reward_path)
    else:
        model_path, reward_path = realistic_models(layers or QWEN25_05B["num_hidden_layers"])

    prompt_words, answer_words = _ROW_WORDS[shape]
    texts = _harness.skewed_texts()
    words = [text.split() for text in texts if len(text.split()) >= prompt_words + answer_words]
    pairs = []
    for i, row in enumerate(words):
        other = words[(i + 7) % len(words)]
        prompt = " ".join(row[:prompt_words])
        chosen = " " + " ".join(row[prompt_words : prompt_words + answer_words])
        rejected = " " + " ".join(other[-answer_words:])
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    unpaired = []
    for i, pair in enumerate(pairs):
        good = i % 2 == 0
        unpaired.append(
            {"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good}
        )
    if shape == "small":
        prompts = [{"prompt": " ".join(row[:48])} for row in words]
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        prompts = [{"prompt": p} for p in _harness.build_prompts(tokenizer, GRPO_PROMPT_TOKENS, 64)["prompt"]]
    conversations = [
        {"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["chosen"]}]}
        for p in pairs
    ]
    datasets = {
        "text": [{"text": t} for t in texts],
        "preference": pairs,
        "unpaired": unpaired,
        "prompts": prompts,
        "conversations": conversations,
        "triples": [{**pair, "reference": pair["chosen"]} for pair in pairs],
        "privileged": [{**row, "privileged_context": pair["chosen"]} for row, pair in zip(prompts, pairs)],
    }
    paths = {"model": model_path, "reward_model": reward_path}
    for name, rows in datasets.items():
        path = os.path.join(workdir, f"{name}.jsonl")
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        paths[name] = path
    return paths


# `--ablate NAME`: the fast path's predicates (module, space-separated functions) and the value that makes each take
# the plain path.
ABLATIONS = {
    "tied_embedding_grad": (
        "trl.trainer.fast_paths.tied_embedding_grad",
        "tied_embedding_grad_fallback_reason",
        "off",
    ),
    "prefix_sharing": ("trl.trainer.fast_paths.prefix_sharing", "supports_prefix_sharing sharing_possible_now", False),
    "rollout_decode": ("trl.trainer.fast_paths.rollout_decode", "rollout_decode_fallback_reason", "off"),
    "small_row_linear": ("trl.trainer.fast_paths.small_row_linear", "small_row_linear_fallback_reason", "off"),
    "last_layer_selection": (
        "trl.trainer.fast_paths.last_layer_selection",
        "last_layer_selection_fallback_reason",
        "off",
    ),
    "fused_lm_head": ("trl.trainer.utils.logprobs", "fusable_lm_head", None),
    "layer_checkpoints": ("trl.trainer.fast_paths.layer_checkpoints", "layer_checkpoint_fallback_reason", "off"),
    # The layers `LayerBudget` keeps uncheckpointed: none when no forward's head output is bounded.
    "kept_layers": ("trl.trainer.utils.logprobs", "head_output_bytes", None),
    "lean_modules": ("trl.trainer.fast_paths.lean_modules", "lean_modules_applicable", False),
    "cpu_allocator": ("trl.trainer.fast_paths.cpu_allocator", "activation_memory_fallback_reason", "off"),
    "reference_cache": ("trl.trainer.fast_paths.reference_cache", "training_revisits_examples", False),
    "packed_attention": ("trl.trainer.utils.packing", "packed_sdpa_applicable", False),
    "optimizer_in_backward": (
        "trl.trainer.fast_paths.optimizer_in_backward",
        "optimizer_in_backward_fallback_reason",
        "off",
    ),
    # With clipping: one backward pass holding every gradient instead of two that never hold them together.
    "two_pass_clip": ("trl.trainer.fast_paths.optimizer_in_backward", "_two_pass_fallback_reason", "off"),
}


def ablate(name: str) -> None:
    """Makes the fast path `name` take its plain path in this process: its predicate is replaced wherever `trl`'s
    modules hold it (they import it by name), by a function returning the value that declines it."""
    import importlib

    module_name, function_names, declined = ABLATIONS[name]
    importlib.import_module("trl.trainer")  # every trainer module, so that each import of the predicate is found
    for function_name in function_names.split():
        original = getattr(importlib.import_module(module_name), function_name)
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("trl") and getattr(module, function_name, None) is original:
                setattr(module, function_name, lambda *args, **kwargs: declined)


def job_size(job: str, args: argparse.Namespace) -> tuple[int, int]:
    """Per-device batch size and `max_length` of `job` at `args.shape`."""
    if args.shape == "small":
        return (4 if job in ("dpo", "orpo", "cpo", "tpo", "bema_dpo") else 8), args.max_length
    return REALISTIC_JOBS[job]


def run_worker(
    side: str, job: str, args: argparse.Namespace, paths: dict, python: str, ablate_name: str | None = None
) -> dict:
    """Runs one job in a fresh interpreter of `side` ("ours" or "trl") and returns the JSON line it printed; with
    `ablate_name`, this project's side runs with that fast path declined (see `ABLATIONS`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    if side == "ours":
        env["PYTHONPATH"] = REPO
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["MKL_NUM_THREADS"] = str(args.threads)
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    batch, max_length = job_size(job, args)
    spec = {"job": job, "side": side, "steps": args.steps, "warmup": args.warmup, "threads": args.threads}
    spec.update({"quick": args.quick, "batch": batch, "max_length": max_length, "paths": paths})
    spec["ablate"] = ablate_name
    spec["config"] = args.config
    spec["rows"] = args.rows
    spec["lora"] = args.lora
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
    """Model FLOPs per token (forward, backward, recompute) of the model at `model_path` at `seq_len`."""
    from transformers import AutoConfig

    from trl.trainer.utils.flops import compute_flops_per_token

    return compute_flops_per_token(AutoConfig.from_pretrained(model_path), max(seq_len, 1))


def summarise(job: str, ours: list[dict], trl: list[dict], peak: float, paths: dict) -> dict:
    """One table row from each side's runs of `job`: medians, ratios ours / TRL, and whether the final losses agree.

    Args:
        job (`str`):
            The job's name.
        ours (`list[dict]`), trl (`list[dict]`):
            The result lines of each side's runs.
        peak (`float`):
            The matmul FLOPs per CPU-second that MFU is measured against (MFU is left out on a GPU).
        paths (`dict`):
            What `prepare_inputs` returned (the model path, for its FLOPs per token).
    """

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    row = {"job": job, "device": trl[-1].get("device", "cpu")}
    # The job's real tokens per step, counted on TRL's side (ours may lay the same tokens out differently).
    # (With --ablate both sides are this project: the counts of whichever side recorded them.)
    counted = next((rows[-1] for rows in (trl, ours) if rows[-1]["items_per_step"]), trl[-1])
    tokens, seq_len, items = counted["tokens_per_step"], counted["seq_len"], counted["items_per_step"]
    for side, rows in (("ours", ours), ("trl", trl)):
        row[f"{side}_cpu_s"] = med(rows, "cpu_s")
        row[f"{side}_wall_s"] = med(rows, "wall_s")
        row[f"{side}_rss_mb"] = med(rows, "peak_rss_mb")
        row[f"{side}_tensor_mb"] = med(rows, "tensor_peak_mb")
        row[f"{side}_loss"] = rows[-1]["final_loss"]
        row[f"{side}_rate"] = items / row[f"{side}_wall_s"]
        on_cpu = row["device"] == "cpu"
        row[f"{side}_mfu"] = (
            flops_per_token(paths["model"], seq_len) * tokens / row[f"{side}_cpu_s"] / peak if on_cpu else None
        )
    row["unit"] = ours[-1]["unit"]
    for key, field in (("cpu_ratio", "cpu_s"), ("rss_ratio", "rss_mb"), ("tensor_ratio", "tensor_mb")):
        row[key] = row[f"ours_{field}"] / row[f"trl_{field}"]
    row["rate_ratio"] = row["ours_rate"] / row["trl_rate"] if row["trl_rate"] else float("nan")
    scale = max(abs(row["trl_loss"]), 1e-3)
    row["loss_agrees"] = abs(row["ours_loss"] - row["trl_loss"]) <= 1e-3 * scale + 1e-5
    return row


def print_table(rows: list[dict]) -> None:
    """Prints the rows of `summarise` as a markdown table."""
    head = (
        "| job | CPU s/step ours / TRL | ratio | peak RSS MB ours / TRL | ratio | peak tensors MB ours / TRL | ratio "
        "| rate ours / TRL | ratio | MFU ours / TRL | final loss ours / TRL |"
    )
    print(head)
    print("|" + "---|" * 11)
    for r in rows:
        loss = f"{r['ours_loss']:.6g} / {r['trl_loss']:.6g}" + ("" if r["loss_agrees"] else " (DIFFER)")
        mfu = "-" if r["ours_mfu"] is None else f"{100 * r['ours_mfu']:.0f} % / {100 * r['trl_mfu']:.0f} %"
        print(
            f"| {r['job']} | {r['ours_cpu_s']:.3f} / {r['trl_cpu_s']:.3f} | {r['cpu_ratio']:.2f} "
            f"| {r['ours_rss_mb']:.0f} / {r['trl_rss_mb']:.0f} | {r['rss_ratio']:.2f} "
            f"| {r['ours_tensor_mb']:.0f} / {r['trl_tensor_mb']:.0f} | {r['tensor_ratio']:.2f} "
            f"| {r['ours_rate']:.1f} / {r['trl_rate']:.1f} {r['unit']} | {r['rate_ratio']:.2f} "
            f"| {mfu} | {loss} |"
        )


def main() -> int:
    """Runs the comparison the command line asks for (or, with the hidden `--_worker`, one job of one side)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    parser.add_argument(
        "--jobs",
        default=",".join(JOBS),
        help=f"comma-separated subset of {', '.join(JOBS + EXTRA_JOBS)} (default: the first six)",
    )
    parser.add_argument("--shape", default="small", choices=SHAPES, help="model shape and job sizes (see above)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the qwen2.5-0.5b shape")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 12; qwen2.5-0.5b 4)")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before the measured ones")
    parser.add_argument("--rounds", type=int, default=1, help="runs per job and side, interleaved")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max_length", type=int, default=512, help="the small shape's max_length")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps: a smoke test of the program")
    parser.add_argument(
        "--trl_python", default=None, help="interpreter with trl==1.16.0 (default: the parity venv; bco: the 1.12 one)"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument(
        "--ablate",
        default=None,
        choices=sorted(ABLATIONS),
        help="compare this project with itself without this fast path (the 'TRL' columns), instead of with TRL",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a config field on both sides (VALUE read as JSON, else a string); repeatable, e.g. "
        "--config gradient_checkpointing=false",
    )
    parser.add_argument(
        "--rows", type=int, default=None, help="train on the first N rows only, so that later steps revisit them"
    )
    parser.add_argument(
        "--lora", type=int, default=None, metavar="R", help="train LoRA adapters of rank R on every linear layer"
    )
    args = parser.parse_args()
    if args._worker:
        worker(json.loads(args._worker))
        return 0
    if args.steps is None:
        args.steps = 12 if args.shape == "small" else 4
    for item in args.config:
        if "=" not in item:
            parser.error(f"--config expects KEY=VALUE, got {item!r}")
    if args.quick:
        if args.shape != "small":
            parser.error("--quick runs the tiny model; for a quick realistic-shape run use --layers and --steps")
        args.steps, args.warmup, args.max_length = 2, 1, 256
    jobs = [job.strip() for job in args.jobs.split(",") if job.strip()]
    unknown = sorted(set(jobs) - set(JOBS + EXTRA_JOBS))
    if unknown:
        parser.error(f"unknown jobs {unknown}; choose from {', '.join(JOBS + EXTRA_JOBS)}")
    if args.lora and "a2po" in jobs:
        parser.error("--lora: A2POTrainer takes no peft_config (nor does TRL's); leave a2po out")
    venv = os.environ.get("PARITY_VENV", "/work/main/.venv-parity")
    trl_python = args.trl_python or os.path.join(venv, "bin", "python")
    if not os.path.exists(trl_python):
        parser.error(f"no TRL 1.16 interpreter at {trl_python}: build it with `make parity-env` or pass --trl_python")
    trl_pythons = {job: trl_python for job in jobs}
    for job in [] if args.trl_python else [job for job in jobs if job in OLDER_TRL_JOBS]:
        variable, default, version = OLDER_TRL_JOBS[job]
        trl_pythons[job] = os.path.join(os.environ.get(variable, default), "bin", "python")
        if not os.path.exists(trl_pythons[job]):
            parser.error(
                f"TRL 1.16 has no {job} trainer; its side runs trl=={version} from {trl_pythons[job]}: build it with "
                f"`make parity-env-{version.replace('.', '')}`, or pass --trl_python"
            )

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as workdir:
        paths = prepare_inputs(workdir, args.quick, args.shape, args.layers)
        peak = measure_matmul_peak(args.threads)
        print(f"shape: {args.shape}, model {paths['model']}", flush=True)
        print(f"matmul peak: {peak / 1e9:.1f} GFLOP per CPU-second ({args.threads} threads)", flush=True)
        print(f"ours: {sys.executable}\ntrl:  {trl_python}", flush=True)
        for job in jobs:
            if trl_pythons[job] != trl_python:
                print(f"trl ({job}): {trl_pythons[job]}", flush=True)
        if args.ablate:
            print(f"--ablate {args.ablate}: the TRL columns are this project without that fast path", flush=True)
        for job in jobs:
            results = {"ours": [], "trl": []}
            for _ in range(args.rounds):
                for side, python in (("ours", sys.executable), ("trl", trl_pythons[job])):
                    if args.ablate and side == "trl":  # the plain path of the fast path stands in for TRL
                        result = run_worker("ours", job, args, paths, sys.executable, args.ablate)
                        result["side"] = f"ours without {args.ablate}"
                    else:
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


def worker(spec: dict) -> None:
    """Trains one job as `spec` describes and prints its result as one JSON line.

    Runs `warmup + steps` timed steps and one more, untimed, over which the live tensor memory is tracked on a CPU.
    """
    threads = spec["threads"]
    import torch

    torch.set_num_threads(threads)
    import _harness
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging

    import trl

    if spec.get("ablate"):
        ablate(spec["ablate"])
    hf_logging.set_verbosity_error()
    job, paths, batch, max_length = spec["job"], spec["paths"], spec["batch"], spec["max_length"]
    cuda = torch.cuda.is_available()
    timed_steps = spec["warmup"] + spec["steps"]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.cpu, self.wall = [], []

        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self._cpu, self._wall = time.process_time(), time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.cpu.append(time.process_time() - self._cpu)
            self.wall.append(time.perf_counter() - self._wall)

    def data(name: str):
        dataset = load_dataset("json", data_files=paths[name], split="train")
        return dataset.select(range(spec["rows"])) if spec.get("rows") else dataset

    common = {
        "output_dir": spec["output_dir"],
        "max_steps": timed_steps + (0 if cuda else 1),
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "per_device_train_batch_size": batch,
        # TRL's configs default to bf16, which a CPU-only machine refuses; on a GPU, bf16 weights and SDPA.
        "bf16": cuda,
    }
    if cuda:
        common["model_init_kwargs"] = {"dtype": "bfloat16", "attn_implementation": "sdpa"}
    for item in spec.get("config", []):
        key, value = item.split("=", 1)
        try:
            common[key] = json.loads(value)
        except json.JSONDecodeError:
            common[key] = value
    max_length = common.pop("max_length", max_length)  # `--config max_length=...` replaces the job's own

    def sharper_teacher():
        # The distillation jobs' teacher (GKD, GOLD, IW-OPD): the student's weights with a final norm twice as large
        # (sharper logits), so the loss and gradients are those of a real distillation from the first step, the same
        # on both sides. With the very same weights the loss is float noise, which Adam amplifies differently.
        teacher = AutoModelForCausalLM.from_pretrained(paths["model"], **common.get("model_init_kwargs", {}))
        with torch.no_grad():
            teacher.get_decoder().norm.weight.mul_(2.0)
        return teacher

    peft = {}
    if spec.get("lora"):  # LoRA adapters on every linear layer, the rest of the model frozen
        from peft import LoraConfig

        task_type = "SEQ_CLS" if job == "reward" else "CAUSAL_LM"
        lora = LoraConfig(
            r=spec["lora"], lora_alpha=2 * spec["lora"], target_modules="all-linear", task_type=task_type
        )
        peft["peft_config"] = lora

    clock = StepClock()
    callbacks = [clock] if cuda else [clock, _tensor_peak_callback(timed_steps)]
    unit = "tokens/s"
    if job in ("sft_padded", "sft_packed"):
        packing = {"packing": True, "packing_strategy": "bfd"} if job == "sft_packed" else {}
        config = trl.SFTConfig(**{**packing, **common}, max_length=max_length)  # `--config` overrides the packing
        trainer = trl.SFTTrainer(paths["model"], args=config, train_dataset=data("text"), callbacks=callbacks, **peft)
    elif job == "dpo":
        config = trl.DPOConfig(**common, max_length=max_length)
        trainer = trl.DPOTrainer(
            paths["model"], args=config, train_dataset=data("preference"), callbacks=callbacks, **peft
        )
    elif job == "reward":
        config = trl.RewardConfig(**common, max_length=max_length)
        dataset = data("preference")
        trainer = trl.RewardTrainer(
            paths["reward_model"], args=config, train_dataset=dataset, callbacks=callbacks, **peft
        )
    elif job in ("kto", "bco"):
        if job == "kto":
            config_class, trainer_class = trl.KTOConfig, trl.KTOTrainer
        else:
            import trl.experimental.bco as bco

            config_class, trainer_class = bco.BCOConfig, bco.BCOTrainer
        config = config_class(**common, max_length=max_length)
        trainer = trainer_class(
            paths["model"], args=config, train_dataset=data("unpaired"), callbacks=callbacks, **peft
        )
    elif job in ("grpo", "rloo", "gmpo"):
        unit = "completions/s"
        if job == "gmpo":
            from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

            config_class, trainer_class = GMPOConfig, GMPOTrainer
        else:
            config_class, trainer_class = (
                (trl.GRPOConfig, trl.GRPOTrainer) if job == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
            )
        config = config_class(**common, num_generations=4, max_completion_length=16 if spec["quick"] else 32)
        trainer = trainer_class(
            paths["model"],
            reward_funcs=_harness.cheap_reward,
            args=config,
            train_dataset=data("prompts"),
            callbacks=callbacks,
            **peft,
        )
    elif job == "distillation":
        # On-policy distillation from a teacher of the same shape (a second copy of the weights).
        unit = "completions/s"
        config = trl.DistillationConfig(**common, max_completion_length=16 if spec["quick"] else 32)
        trainer = trl.DistillationTrainer(
            paths["model"],
            teacher_model=paths["model"],
            args=config,
            train_dataset=data("prompts"),
            callbacks=callbacks,
            **peft,
        )
    elif job in ("orpo", "cpo"):
        import importlib

        module = importlib.import_module(f"trl.experimental.{job}")
        prefix = job.upper()
        config = getattr(module, f"{prefix}Config")(**common, max_length=max_length)
        trainer_class = getattr(module, f"{prefix}Trainer")
        trainer = trainer_class(
            paths["model"], args=config, train_dataset=data("preference"), callbacks=callbacks, **peft
        )
    elif job == "gkd":
        # Generalized knowledge distillation from a teacher of the same shape, half the steps on-policy (lmbda 0.5).
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        config = GKDConfig(**common, max_length=max_length, max_new_tokens=16 if spec["quick"] else 32)
        trainer = GKDTrainer(
            paths["model"],
            teacher_model=sharper_teacher(),
            args=config,
            processing_class=AutoTokenizer.from_pretrained(paths["model"]),  # TRL's GKD does not load it
            train_dataset=data("conversations"),
            callbacks=callbacks,
            **peft,
        )
    elif job == "online_dpo":
        # Two completions per prompt, scored by the cheap reward function.
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        unit = "completions/s"
        config = OnlineDPOConfig(**common, max_length=max_length, max_new_tokens=16 if spec["quick"] else 32)
        trainer = OnlineDPOTrainer(
            paths["model"],
            reward_funcs=_harness.cheap_reward,
            args=config,
            train_dataset=data("prompts"),
            processing_class=AutoTokenizer.from_pretrained(paths["model"]),  # TRL requires it
            callbacks=callbacks,
            **peft,
        )
    elif job in ("gold", "iw_opd"):
        # On-policy distillation variants, from GKD's teacher.
        import importlib

        unit = "completions/s"
        module = importlib.import_module(f"trl.experimental.{job}")
        prefix = {"gold": "GOLD", "iw_opd": "IWOPD"}[job]
        config = getattr(module, f"{prefix}Config")(
            **common, max_length=max_length, max_completion_length=16 if spec["quick"] else 32
        )
        trainer = getattr(module, f"{prefix}Trainer")(
            paths["model"],
            teacher_model=sharper_teacher(),
            args=config,
            train_dataset=data("conversations"),
            processing_class=AutoTokenizer.from_pretrained(paths["model"]),  # TRL's does not load it
            callbacks=callbacks,
            **peft,
        )
    elif job in ("sdft", "sdpo", "a2po"):
        # Self-distillation (SDFT: privileged context; SDPO: rewarded demonstrations) and A2PO (value samples), 4
        # completions (A2PO: value samples) per prompt.
        import importlib

        unit = "completions/s"
        module = importlib.import_module(f"trl.experimental.{job}")
        prefix = job.upper()
        sizes = {"max_completion_length": 16 if spec["quick"] else 32}
        sizes.update({"num_value_samples": 4} if job == "a2po" else {"num_generations": 4})
        config = getattr(module, f"{prefix}Config")(**common, **sizes)
        extra = {} if job == "sdft" else {"reward_funcs": _harness.cheap_reward}
        if job == "a2po":  # A2PO passes rewards the completions' text only

            def text_reward(completions, **kwargs):
                return [sum(c.isalpha() for c in text) / max(len(text), 1) for text in completions]

            extra["reward_funcs"] = text_reward
        trainer = getattr(module, f"{prefix}Trainer")(
            paths["model"],
            args=config,
            train_dataset=data("privileged" if job == "sdft" else "prompts"),
            callbacks=callbacks,
            **peft,
            **extra,
        )
    elif job == "bema_dpo":
        # DPO whose reference follows the policy's bias-corrected EMA, refreshed (and loaded into the reference) every
        # step: the callback's own cost on top of DPO's.
        from trl.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

        config = trl.DPOConfig(**common, max_length=max_length)
        bema = BEMACallback(update_freq=1, update_ref_model=True, ref_model_update_freq=1)
        trainer = DPOTrainer(
            paths["model"], args=config, train_dataset=data("preference"), callbacks=[*callbacks, bema], **peft
        )
    elif job == "tpo":
        from trl.experimental.tpo import TPOConfig, TPOTrainer

        config = TPOConfig(**common, max_length=max_length)
        trainer = TPOTrainer(paths["model"], args=config, train_dataset=data("triples"), callbacks=callbacks, **peft)
    else:
        raise ValueError(f"unknown job {job!r}")

    counter = _TokenCounter(trainer, job)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    measured = slice(spec["warmup"], timed_steps)
    tokens_per_step, seq_len = counter.per_step(spec["warmup"], timed_steps)
    tensor_peak = torch.cuda.max_memory_allocated() if cuda else callbacks[-1].peak_bytes
    result = {
        "job": job,
        "side": spec["side"],
        "device": "cuda" if cuda else "cpu",
        "trl_file": os.path.dirname(trl.__file__),
        "cpu_s": statistics.median(clock.cpu[measured]),
        "wall_s": statistics.median(clock.wall[measured]),
        "peak_rss_mb": _harness.peak_rss_mb(ndigits=None),
        "tensor_peak_mb": tensor_peak / 2**20,
        "final_loss": losses[min(timed_steps, len(losses)) - 1],  # the last timed step's (logged every step)
        "tokens_per_step": tokens_per_step,
        "seq_len": seq_len,
        "items_per_step": batch * (2.0 if job == "online_dpo" else 1.0)
        if unit == "completions/s"
        else tokens_per_step,
        "unit": unit,
    }
    print(json.dumps(result), flush=True)


def _live_tensor_bytes() -> int:
    """Bytes of the distinct CPU tensor storages that Python objects reach (weights, optimizer state, buffers)."""
    import gc

    import torch

    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without a storage of their own
                continue
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _tensor_peak_callback(step: int):
    """A callback measuring the peak of live CPU tensor memory over training step `step` (0-based) into `peak_bytes`.

    The peak is the tensors alive when the step starts plus the most the CPU allocator held on top of them during the
    step: the running total of the allocations made (and not yet freed) since the step started, from the memory
    events of `torch.profiler`. Tensors alive at the start and freed during the step still count (an upper bound).
    """
    import torch
    from transformers import TrainerCallback

    class TensorPeak(TrainerCallback):
        def __init__(self):
            self.peak_bytes, self._profiler, self._baseline = 0, None, 0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                self._baseline = _live_tensor_bytes()
                activities = [torch.profiler.ProfilerActivity.CPU]
                self._profiler = torch.profiler.profile(activities=activities, profile_memory=True)
                self._profiler.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self._profiler is None:
                return
            self._profiler.__exit__(None, None, None)
            totals, start = [], None
            nodes = list(self._profiler.profiler.kineto_results.experimental_event_tree())
            while nodes:
                node = nodes.pop()
                nodes.extend(node.children)
                fields = node.extra_fields
                if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
                    totals.append((node.start_time_ns, fields.total_allocated, fields.alloc_size))
            if totals:
                totals.sort()
                start = totals[0][1] - totals[0][2]  # what the allocator's count held before the step
            self.peak_bytes = self._baseline + (max(total for _, total, _ in totals) - start if totals else 0)
            self._profiler = None

    return TensorPeak()


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
            if not isinstance(ids, torch.Tensor):
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

        # A reward model's backbone: the project's pooled-score paths call it (and the score head) directly, and step
        # aside for hooks on the model itself.
        model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model  # PEFT
        target = model.base_model if job == "reward" else trainer.model
        target.register_forward_pre_hook(hook, with_kwargs=True)
        self._install_step_boundary()

    def _install_step_boundary(self):
        from transformers import TrainerCallback

        counter = self

        class Boundary(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                counter.tokens.append(counter.current)
                counter.current = 0

        self.trainer.add_callback(Boundary())

    def per_step(self, warmup: int, end: int) -> tuple[float, int]:
        """Mean real tokens per step over steps `warmup` to `end` (all steps when none), and the mean row length."""
        tokens = self.tokens[warmup:end] or self.tokens
        return statistics.mean(tokens), int(statistics.mean(self.lengths)) if self.lengths else 1


if __name__ == "__main__":
    sys.exit(main())

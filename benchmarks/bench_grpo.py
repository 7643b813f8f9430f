"""GRPO step cost: rollout (generation + rewards + extra forward passes) vs training, and completions per second.

Three configurations per model, each in its own subprocess (so peak RSS is per configuration):

- `baseline`: what a straightforward implementation does, `generate` on the prompts repeated `num_generations`
  times (every completion re-encodes its prompt) and an extra no-grad forward pass for the old-policy log-probs;
- `+shared prompt cache`: each distinct prompt is prefilled once and its KV cache is copied to its group;
- `+skip old-logp pass`: additionally, the old-policy log-probs are the detached current ones when the data is
  on-policy (one optimizer step per generation round, `num_iterations=1`), which is the default trainer behaviour.

Prompts are built from the length-skewed test corpus and cut to `--prompt_tokens` tokens, so that the prompt share of
the work is realistic (reasoning prompts are often a few hundred tokens).

Usage:
    python benchmarks/bench_grpo.py                              # tiny and ~30M models
    python benchmarks/bench_grpo.py --models small --steps 6 --prompt_tokens 256 --threads 2

Reports per model and configuration: median step time, rollout / generation / training time per step (from the
trainer's `timing/*` metrics), completions per second, and peak RSS.

`--clock cpu` (the default) measures process CPU time instead of wall time and runs torch on one thread: on a shared
machine wall times swing with the load of other processes, CPU time of a single-threaded run does not. Use
`--clock wall --threads N` on a dedicated machine.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys


MODELS = {"tiny": "tiny-Qwen2ForCausalLM", "small": "small-Qwen2ForCausalLM"}
CONFIGS = ["baseline", "+shared prompt cache", "+skip old-logp pass"]


def build_prompts(tokenizer, prompt_tokens: int, count: int):
    from datasets import Dataset

    from trl.assets import load_test_dataset

    texts = load_test_dataset("length_skewed_language_modeling", split="train")["text"]
    corpus_ids = tokenizer(" ".join(texts))["input_ids"]
    prompts = []
    for i in range(count):
        start = (i * 997) % max(1, len(corpus_ids) - prompt_tokens)
        prompts.append(tokenizer.decode(corpus_ids[start : start + prompt_tokens]))
    return Dataset.from_dict({"prompt": prompts})


def run_one(model_key: str, config_name: str, args: argparse.Namespace) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from trl import GRPOConfig, GRPOTrainer
    from trl.assets import get_model_path

    hf_logging.set_verbosity_error()
    if args.clock == "cpu":
        import time
        import types

        from trl.trainer import online_base

        # The trainer's timers read `time.perf_counter`; point them at the process CPU clock for this run.
        online_base.time = types.SimpleNamespace(perf_counter=time.process_time)
        torch.set_num_threads(1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_path = get_model_path(MODELS[model_key])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = build_prompts(tokenizer, args.prompt_tokens, 64)

    class BaselineTrainer(GRPOTrainer):
        _share_prompt_cache = False

        def _needs_rollout_logps(self):
            return True

    class SharedCacheTrainer(GRPOTrainer):
        def _needs_rollout_logps(self):
            return True

    trainer_class = {"baseline": BaselineTrainer, "+shared prompt cache": SharedCacheTrainer}.get(
        config_name, GRPOTrainer
    )

    def reward(completion_ids, **kwargs):
        return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    config = GRPOConfig(
        output_dir=f"/tmp/bench-grpo-{model_key}",
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.completion_tokens,
        # never stop early, so every configuration generates exactly the same number of tokens
        generation_kwargs={"eos_token_id": None},
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    trainer = trainer_class(model_path, reward_funcs=reward, args=config, train_dataset=dataset)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "step_time" in log][1:]  # first step includes warm-up

    def median(key):
        return statistics.median(log[key] for log in logs)

    step = median("step_time")
    return {
        "model": model_key,
        "config": config_name,
        "params_M": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1),
        "step_s": round(step, 3),
        "rollout_s": round(median("timing/rollout"), 3),
        "generation_s": round(median("timing/generation"), 3),
        "training_s": round(median("timing/training"), 3),
        "completions_per_s": round(args.batch_size / step, 2),
        "peak_rss_MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=16, help="completions per step (per device)")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--prompt_tokens", type=int, default=256)
    parser.add_argument("--completion_tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads with --clock wall")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._one:
        print(json.dumps(run_one(args._one[0], args._one[1], args)))
        return

    rows = []
    for model_key in args.models:
        for config_name in args.configs:
            cmd = [sys.executable, __file__, "--_one", model_key, config_name]
            keys = ("steps", "batch_size", "num_generations", "prompt_tokens", "completion_tokens", "threads", "clock")
            for key in keys:
                value = getattr(args, key)
                if value is not None:
                    cmd += [f"--{key}", str(value)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)

    header = (
        "| model | params (M) | config | step (s) | rollout (s) | generate (s) | training (s) | completions/s |"
        " peak RSS (MB) |"
    )
    print("\n" + header + "\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params_M']} | {r['config']} | {r['step_s']} | {r['rollout_s']} | "
            f"{r['generation_s']} | {r['training_s']} | {r['completions_per_s']} | {r['peak_rss_MB']} |"
        )


if __name__ == "__main__":
    main()

"""Online DPO, XPO and Nash-MD step cost: rollout (generation + scoring + reference pass) vs training.

Configurations, each in its own subprocess (so peak RSS is per configuration):

- `online_dpo (no shared prompt cache)`: both completions of a prompt re-encode the prompt;
- `online_dpo`: the default, the pair shares one prompt prefill (see `generate_with_shared_prompts`);
- `xpo`: one policy completion and one reference completion per prompt, plus the exploration term;
- `nash_md`: one policy completion and one sampled from the geometric mixture (the reference runs alongside the policy
  at every decoding step, with its own KV cache).

Prompts are cut from the length-skewed test corpus to `--prompt_tokens` tokens; completions never stop early, so every
configuration generates the same number of tokens. Scores come from a cheap reward function, so the reward model does
not dominate.

Usage:
    python benchmarks/bench_online_dpo.py                          # tiny and ~30M models
    python benchmarks/bench_online_dpo.py --models small --steps 6 --prompt_tokens 256

Reports per model and configuration: median step time, rollout / generation / training time per step (from the
trainers' `timing/*` metrics), prompt pairs per second, and peak RSS. `--clock cpu` (default) measures process CPU time
on one torch thread, which is stable on a shared machine; use `--clock wall --threads N` on a dedicated one.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys


MODELS = {"tiny": "tiny-Qwen2ForCausalLM", "small": "small-Qwen2ForCausalLM"}
CONFIGS = ["online_dpo (no shared prompt cache)", "online_dpo", "xpo", "nash_md"]


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
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from trl.assets import get_model_path
    from trl.experimental.nash_md import NashMDConfig, NashMDTrainer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    from trl.experimental.xpo import XPOConfig, XPOTrainer

    hf_logging.set_verbosity_error()
    if args.clock == "cpu":
        import time
        import types

        from trl.experimental.online_dpo import online_dpo_trainer
        from trl.trainer import online_base

        # The trainers' timers read `time.perf_counter`; point them at the process CPU clock for this run.
        clock = types.SimpleNamespace(perf_counter=time.process_time)
        online_base.time = clock
        online_dpo_trainer.time = clock
        torch.set_num_threads(1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_path = get_model_path(MODELS[model_key])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = build_prompts(tokenizer, args.prompt_tokens, 64)

    class NoSharedCacheTrainer(OnlineDPOTrainer):
        _share_prompt_cache = False

    trainer_class, config_class = {
        "online_dpo (no shared prompt cache)": (NoSharedCacheTrainer, OnlineDPOConfig),
        "online_dpo": (OnlineDPOTrainer, OnlineDPOConfig),
        "xpo": (XPOTrainer, XPOConfig),
        "nash_md": (NashMDTrainer, NashMDConfig),
    }[config_name]

    def reward(completion_ids, **kwargs):
        return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    config = config_class(
        output_dir=f"/tmp/bench-online-dpo-{model_key}",
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        max_new_tokens=args.completion_tokens,
        generation_kwargs={"eos_token_id": None},  # never stop early
        learning_rate=1e-6,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    trainer = trainer_class(model=model_path, reward_funcs=reward, args=config, train_dataset=dataset)
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
        "pairs_per_s": round(args.batch_size / step, 2),
        "peak_rss_MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=8, help="prompts per step (per device)")
    parser.add_argument("--prompt_tokens", type=int, default=128)
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
            for key in ("steps", "batch_size", "prompt_tokens", "completion_tokens", "threads", "clock"):
                value = getattr(args, key)
                if value is not None:
                    cmd += [f"--{key}", str(value)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)

    header = (
        "| model | params (M) | config | step (s) | rollout (s) | generate (s) | training (s) | pairs/s |"
        " peak RSS (MB) |"
    )
    print("\n" + header + "\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params_M']} | {r['config']} | {r['step_s']} | {r['rollout_s']} | "
            f"{r['generation_s']} | {r['training_s']} | {r['pairs_per_s']} | {r['peak_rss_MB']} |"
        )


if __name__ == "__main__":
    main()

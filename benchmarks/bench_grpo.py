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

import _harness


CONFIGS = ["baseline", "+shared prompt cache", "+skip old-logp pass"]


def run_one(model_key: str, config_name: str, args: argparse.Namespace) -> dict:
    _harness.setup_offline()
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import online_base, online_generation

    # The trainer's timers read `time.perf_counter` in online_base (rollout, step) and online_generation (generation).
    model_path, dataset = _harness.prepare_online_run(model_key, args, [online_base, online_generation])

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
    config = GRPOConfig(
        **_harness.training_kwargs(f"/tmp/bench-grpo-{model_key}", args.steps, args.batch_size, logging_steps=1),
        num_generations=args.num_generations,
        max_completion_length=args.completion_tokens,
        # never stop early, so every configuration generates exactly the same number of tokens
        generation_kwargs={"eos_token_id": None},
        learning_rate=1e-5,
    )
    trainer = trainer_class(model_path, reward_funcs=_harness.cheap_reward, args=config, train_dataset=dataset)
    trainer.train()
    return _harness.online_step_row(trainer, model_key, config_name, "completions_per_s", args.batch_size)


def main() -> None:
    parser = _harness.make_parser(__doc__)
    _harness.add_grid_arguments(
        parser, CONFIGS, steps=6, batch_size=16, batch_help="completions per step (per device)"
    )
    parser.add_argument("--num_generations", type=int, default=8)
    _harness.add_online_arguments(parser, prompt_tokens=256, completion_tokens=32)
    args = parser.parse_args()

    flags = [*_harness.ONLINE_FLAGS, "num_generations"]
    rows = _harness.drive_grid(__file__, args, run_one, flags, args.configs)
    if rows is None:
        return
    _harness.print_table(rows, _harness.online_columns(("completions/s", "completions_per_s")))


if __name__ == "__main__":
    main()

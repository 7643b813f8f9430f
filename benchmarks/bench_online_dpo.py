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

import _harness


CONFIGS = ["online_dpo (no shared prompt cache)", "online_dpo", "xpo", "nash_md"]


def run_one(model_key: str, config_name: str, args: argparse.Namespace) -> dict:
    _harness.setup_offline(experimental=True)
    from trl.experimental.nash_md import NashMDConfig, NashMDTrainer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer, online_dpo_trainer
    from trl.experimental.xpo import XPOConfig, XPOTrainer
    from trl.trainer import online_base, online_generation

    # The trainers' timers read `time.perf_counter` in these modules.
    model_path, dataset = _harness.prepare_online_run(
        model_key, args, [online_base, online_generation, online_dpo_trainer]
    )

    class NoSharedCacheTrainer(OnlineDPOTrainer):
        _share_prompt_cache = False

    trainer_class, config_class = {
        "online_dpo (no shared prompt cache)": (NoSharedCacheTrainer, OnlineDPOConfig),
        "online_dpo": (OnlineDPOTrainer, OnlineDPOConfig),
        "xpo": (XPOTrainer, XPOConfig),
        "nash_md": (NashMDTrainer, NashMDConfig),
    }[config_name]
    config = config_class(
        **_harness.training_kwargs(f"/tmp/bench-online-dpo-{model_key}", args.steps, args.batch_size, logging_steps=1),
        max_new_tokens=args.completion_tokens,
        generation_kwargs={"eos_token_id": None},  # never stop early
        learning_rate=1e-6,
    )
    trainer = trainer_class(model=model_path, reward_funcs=_harness.cheap_reward, args=config, train_dataset=dataset)
    trainer.train()
    return _harness.online_step_row(trainer, model_key, config_name, "pairs_per_s", args.batch_size)


def main() -> None:
    parser = _harness.make_parser(__doc__)
    _harness.add_grid_arguments(parser, CONFIGS, steps=5, batch_size=8, batch_help="prompts per step (per device)")
    _harness.add_online_arguments(parser, prompt_tokens=128, completion_tokens=32)
    args = parser.parse_args()

    rows = _harness.drive_grid(__file__, args, run_one, _harness.ONLINE_FLAGS, args.configs)
    if rows is None:
        return
    _harness.print_table(rows, _harness.online_columns(("pairs/s", "pairs_per_s")))


if __name__ == "__main__":
    main()

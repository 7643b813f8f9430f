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

import _harness


CONFIGS = ["reward", "reward-2pass", "prm"]


def run_one(model_key: str, config: str, args: argparse.Namespace) -> dict:
    steps, batch_size = args.steps, args.batch_size
    _harness.setup_offline(experimental=True)
    import torch
    import torch.nn.functional as F

    from trl import RewardConfig, RewardTrainer
    from trl.assets import get_model_path, load_test_dataset
    from trl.experimental.prm import PRMConfig, PRMTrainer

    torch.manual_seed(0)

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

    timer = _harness.step_timer()
    common = _harness.training_kwargs(f"/tmp/bench-reward-{model_key}-{config}", steps, batch_size)
    model_path = get_model_path(_harness.MODELS[model_key])
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
    step = _harness.warm_median(timer.times)
    return {
        "model": model_key,
        "config": config,
        "params_M": _harness.params_millions(trainer.model),
        "step_s": round(step, 4),
        "examples_per_s": round(batch_size / step, 1),
        "tokens_per_s": round(real / steps / step, 1),
        "peak_rss_MB": _harness.peak_rss_mb(),
    }


def main() -> None:
    parser = _harness.make_parser(__doc__)
    _harness.add_grid_arguments(parser, CONFIGS, steps=12, batch_size=8)
    args = parser.parse_args()

    rows = _harness.drive_grid(__file__, args, run_one, ["steps", "batch_size"], args.configs)
    if rows is None:
        return
    _harness.print_table(
        rows,
        [
            *_harness.MODEL_COLUMNS,
            ("config", "config"),
            ("step (s)", "step_s"),
            ("examples/s", "examples_per_s"),
            ("real tokens/s", "tokens_per_s"),
            _harness.PEAK_RSS_COLUMN,
        ],
    )


if __name__ == "__main__":
    main()

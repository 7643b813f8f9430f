"""SFT throughput: padded vs packed vs padding-free batches on a length-skewed dataset.

Each configuration runs in its own subprocess so that peak RSS is measured per configuration.

Usage:
    python benchmarks/bench_sft.py                      # tiny and ~30M models, all three layouts
    python benchmarks/bench_sft.py --models tiny --steps 10

Reports, per model and layout: median step time, real (non-padding) tokens per second, the fraction of computed
positions that were padding, and peak RSS.
"""

import argparse

import _harness


LAYOUTS = {
    "padded": {},
    "packed (bfd)": {"packing": True, "packing_strategy": "bfd"},
    # Padding-free without packing does not truncate (TRL refuses a max_length there).
    "padding-free": {"padding_free": True, "max_length": None},
}


def run_one(model_key: str, layout: str, args: argparse.Namespace) -> dict:
    steps, batch_size, max_length = args.steps, args.batch_size, args.max_length
    _harness.setup_offline()
    import torch

    from trl import SFTConfig, SFTTrainer
    from trl.assets import get_model_path, load_test_dataset

    torch.manual_seed(0)
    dataset = load_test_dataset("length_skewed_language_modeling", split="train")
    timer = _harness.step_timer()
    config = SFTConfig(
        **_harness.training_kwargs(f"/tmp/bench-sft-{model_key}", steps, batch_size),
        **{"max_length": max_length, **LAYOUTS[layout]},
    )
    trainer = SFTTrainer(
        model=get_model_path(_harness.MODELS[model_key]), args=config, train_dataset=dataset, callbacks=[timer]
    )

    # Count real and computed positions over the batches the run will see.
    real, computed = 0, 0
    loader = trainer.get_train_dataloader()
    for i, batch in enumerate(loader):
        if i >= steps:
            break
        real += int((batch["labels"] != -100).sum()) + batch["input_ids"].shape[0]
        computed += batch["input_ids"].numel()
    trainer.train()
    step = _harness.warm_median(timer.times)
    return {
        "model": model_key,
        "layout": layout,
        "params_M": _harness.params_millions(trainer.model),
        "step_s": round(step, 4),
        "tokens_per_s": round(real / steps / step, 1),
        "padding_fraction": round(1 - real / computed, 3) if computed else 0.0,
        "peak_rss_MB": _harness.peak_rss_mb(),
    }


def main() -> None:
    parser = _harness.make_parser(__doc__)
    _harness.add_grid_arguments(parser, LAYOUTS, steps=12, batch_size=8, configs_flag="--layouts")
    parser.add_argument("--max_length", type=int, default=1024)
    args = parser.parse_args()

    rows = _harness.drive_grid(__file__, args, run_one, ["steps", "batch_size", "max_length"], args.layouts)
    if rows is None:
        return
    _harness.print_table(
        rows,
        [
            *_harness.MODEL_COLUMNS,
            ("layout", "layout"),
            ("step (s)", "step_s"),
            ("real tokens/s", "tokens_per_s"),
            ("padding", _harness.percent("padding_fraction")),
            _harness.PEAK_RSS_COLUMN,
        ],
    )


if __name__ == "__main__":
    main()

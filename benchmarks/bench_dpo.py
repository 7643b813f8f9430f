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

import _harness


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

    texts = _harness.skewed_texts()
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


def run_one(model_key: str, config_name: str, args: argparse.Namespace) -> dict:
    steps, batch_size, max_length = args.steps, args.batch_size, args.max_length
    _harness.setup_offline()
    import torch

    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    dataset = build_dataset(batch_size * steps)
    trainer, timer, init_s = _harness.build_preference_trainer(
        DPOTrainer, DPOConfig, model_key, CONFIGS[config_name], dataset, steps, batch_size, max_length
    )

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
    padding = round(1 - real / computed, 3) if computed else 0.0
    return _harness.preference_row(trainer, timer, init_s, model_key, config_name, {"padding_fraction": padding})


def main() -> None:
    parser = _harness.make_parser(__doc__)
    _harness.add_grid_arguments(parser, CONFIGS, steps=8, batch_size=8)
    parser.add_argument("--max_length", type=int, default=512)
    args = parser.parse_args()

    rows = _harness.drive_grid(__file__, args, run_one, ["steps", "batch_size", "max_length"], args.configs)
    if rows is None:
        return
    _harness.print_table(rows, _harness.preference_columns(("padding", _harness.percent("padding_fraction"))))


if __name__ == "__main__":
    main()

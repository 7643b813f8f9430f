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

Configurations (all with a full reference copy unless stated):
    trl-like        padded batches; policy: main rows with gradient + KL rows in a second, no-grad forward;
                    reference: main rows and KL rows in two forwards (the layout of TRL's KTO trainer)
    padded          padded batches; policy as above; reference: main + KL rows in ONE forward (set explicitly)
    kl-batched      packed (no padding computed); policy: main + KL rows in ONE forward with gradient (the backward
                    pass then also runs over the KL tokens, whose gradient is zero); reference: one packed forward
    kl-separate     packed; policy: main rows with gradient + KL rows in a no-grad forward; reference: main + KL
                    rows in ONE packed forward
    kl-separate-ref-split  packed; as kl-separate, but the reference scores main and KL rows in two
                    forwards shaped like the policy's (the trainer's default: the KL estimate is then exactly 0 while
                    the policy equals the reference, as in TRL)
    no-kl           `loss_type="apo_zero_unpaired"`: no KL rows at all (the floor the KL term is measured against)
    precompute      `precompute_ref_log_probs=True`: reference values (incl. KL) computed once before training
    peft            LoRA (r=16) policy, reference = adapters disabled (no copy), packed, KL as in kl-separate

Reports, per model and configuration: median step time (first step excluded), the share of the step spent on the KL
term (1 - no-kl step / step), peak RSS, the constructor time (tokenization, plus the reference pre-pass for
`precompute`) and the parameter memory of the reference model kept during training.
"""

import argparse
import statistics
import time

import _harness


CONFIGS = {
    "trl-like": {"layout": "padded", "kl_in_policy": False, "kl_in_reference": False},
    "padded": {"layout": "padded", "kl_in_policy": False, "kl_in_reference": True},
    "kl-batched": {"kl_in_policy": True, "kl_in_reference": True},
    "kl-separate": {"kl_in_policy": False, "kl_in_reference": True},
    "kl-separate-ref-split": {"kl_in_policy": False, "kl_in_reference": False},
    "no-kl": {"loss_type": "apo_zero_unpaired"},
    "precompute": {"precompute_ref_log_probs": True},
    "peft": {"peft": True},
}


def build_dataset(num_examples: int):
    from datasets import Dataset

    texts = _harness.skewed_texts()
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


def run_one(model_key: str, config_name: str, args: argparse.Namespace) -> dict:
    steps, batch_size, max_length = args.steps, args.batch_size, args.max_length
    _harness.setup_offline()
    import torch

    from trl import KTOConfig, KTOTrainer

    torch.manual_seed(0)
    options = dict(CONFIGS[config_name])
    kl_in_policy = options.pop("kl_in_policy", None)
    kl_in_reference = options.pop("kl_in_reference", None)
    dataset = build_dataset(batch_size * (steps + 1))
    trainer, timer, init_s = _harness.build_preference_trainer(
        KTOTrainer, KTOConfig, model_key, options, dataset, steps, batch_size, max_length
    )
    if kl_in_policy is not None:
        trainer._kl_in_policy_forward = kl_in_policy
    if kl_in_reference is not None:
        trainer._kl_in_reference_forward = kl_in_reference
    trainer.train()
    return _harness.preference_row(trainer, timer, init_s, model_key, config_name)


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
    _harness.setup_offline()
    import random

    import torch

    from trl import KTOConfig, KTOTrainer
    from trl.assets import get_model_path

    torch.manual_seed(0)
    config = KTOConfig(
        output_dir=f"/tmp/bench-kto-ab-{model_key}",
        per_device_train_batch_size=batch_size,
        max_length=max_length,
        report_to="none",
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    trainer = KTOTrainer(
        get_model_path(_harness.MODELS[model_key]), args=config, train_dataset=build_dataset(batch_size * 8)
    )
    default_layout = trainer._layout
    batches = []
    for i, batch in enumerate(trainer.get_train_dataloader()):
        if i >= num_batches:
            break
        batches.append(batch)
    no_kl_batches = [{k: v for k, v in b.items() if not k.startswith("KL_")} for b in batches]
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
    parser = _harness.make_parser(__doc__)
    _harness.add_grid_arguments(parser, CONFIGS, steps=8, batch_size=8)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument(
        "--ab", action="store_true", help="interleaved in-process timing of the KL scheduling modes (see run_ab)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds of --ab timing")
    args = parser.parse_args()

    if args.ab:
        print(_harness.table_header(["model", "mode", "loss + backward (s)", "KL share"]))
        for model_key in args.models:
            for row in run_ab(model_key, args.repeats, args.batch_size, args.max_length):
                print(_harness.table_row(row[k] for k in ("model", "mode", "loss+backward_s", "KL share")), flush=True)
        return

    rows = _harness.drive_grid(__file__, args, run_one, ["steps", "batch_size", "max_length"], args.configs)
    if rows is None:
        return
    floor = {r["model"]: r["step_s"] for r in rows if r["config"] == "no-kl"}

    def kl_share(r: dict) -> str:
        if r["model"] in floor and r["config"] not in ("no-kl", "precompute", "peft"):
            return f"{1 - floor[r['model']] / r['step_s']:.0%}"
        return "-"

    _harness.print_table(rows, _harness.preference_columns(("KL share", kl_share)))


if __name__ == "__main__":
    main()

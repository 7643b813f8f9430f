"""A tiny end-to-end post-training run on the embedded offline assets (`make demo`).

Builds (or reuses) the tiny Qwen2-style model, its locally trained tokenizer and a small chat dataset, fine-tunes the
model with `SFTTrainer` for a few dozen steps on the CPU, saves it, and prints where it went and the final loss.

Usage: `python -m trl.demo [--output_dir DIR] [--max_steps N]`.
"""

import argparse
import logging
import os
import time


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    """Run the demo and return a summary (`output_dir`, `final_loss`, `first_loss`, `seconds`)."""
    parser = argparse.ArgumentParser(description="Tiny offline SFT run on the embedded default model and dataset.")
    parser.add_argument("--output_dir", default="demo-output/tiny-Qwen2-SFT", help="where the trained model is saved")
    parser.add_argument("--max_steps", type=int, default=40, help="number of optimisation steps")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.perf_counter()

    from transformers.utils import logging as hf_logging

    from trl import SFTConfig, SFTTrainer
    from trl.assets import get_model_path, load_test_dataset

    hf_logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.WARNING)

    model_path = get_model_path("tiny-Qwen2ForCausalLM")
    dataset = load_test_dataset("conversational_prompt_completion")
    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=5,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        gradient_checkpointing=False,
        padding_free=True,
        max_length=None,  # padding-free batches without packing hold whole sequences
        disable_tqdm=True,
        seed=0,
    )
    print(f"Model:   {model_path}")
    print(f"Dataset: conversational_prompt_completion ({len(dataset['train'])} training rows)")
    trainer = SFTTrainer(model=model_path, args=config, train_dataset=dataset["train"])
    trainer.train()
    trainer.save_model(config.output_dir)

    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    summary = {
        "output_dir": os.path.abspath(config.output_dir),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "seconds": time.perf_counter() - start,
    }
    print(
        f"Loss:    {summary['first_loss']:.3f} (step {config.logging_steps}) -> {summary['final_loss']:.3f} "
        f"(step {config.max_steps})"
    )
    print(f"Saved:   {summary['output_dir']}")
    report = os.path.join(summary["output_dir"], "report.html")
    if os.path.isfile(report):
        print(f"Report:  {report} (curves, data summary, config; open it in a browser)")
    print(f"Time:    {summary['seconds']:.1f} s")
    print("Next:    a real model on a GPU, see docs/from_tiny_to_real.md")
    return summary


if __name__ == "__main__":
    main()

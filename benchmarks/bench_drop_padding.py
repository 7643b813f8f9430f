"""When does dropping padding pay? One reward-model step (forward + backward of the ~28M `small` Qwen2 sequence
classifier) on a padded batch vs on its packed sequences, at several shares of padding.

Each batch has 8 rows of width `--width`; row lengths fall evenly from `width` down to `width * (1 - 2 * pad)`, so
`pad` is the share of positions that are padding. Eager/SDPA attention packs into rows no longer than the longest
sequence, so only the positions of the rows that packing saves are saved (the "saved" column), not all the padding. The packed path is [`sequence_scores_without_padding`] (what
`RewardTrainer` uses; SFT's padded batches go through the same [`drop_padding`]). Prints CPU seconds per step for
both paths and their ratio; packing wins once the ratio is clearly below 1.

    python benchmarks/bench_drop_padding.py --threads 2 --width 256 --repeats 5
"""

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pads", default="0.1,0.25,0.3,0.35,0.4,0.45")
    parser.add_argument("--model", default="small-Qwen2ForCausalLM")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForSequenceClassification

    from trl.assets import get_model_path
    from trl.trainer.utils.packing import drop_padding, sequence_scores_without_padding

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(get_model_path(args.model), num_labels=1)
    pad_id = model.config.pad_token_id

    def step(ids, mask, packed):
        start = time.process_time()
        scores = sequence_scores_without_padding(model, ids, mask, min_saved_share=0.0) if packed else None
        if scores is None:
            scores = model(input_ids=ids, attention_mask=mask).logits
        scores.sum().backward()
        model.zero_grad(set_to_none=True)
        return time.process_time() - start

    print("| padding share | positions saved by packing | padded CPU s | packed CPU s | packed / padded |")
    print("|---|---|---|---|---|")
    for pad in (float(p) for p in args.pads.split(",")):
        lengths = torch.linspace(args.width, args.width * (1 - 2 * pad), args.batch).round().long()
        mask = (torch.arange(args.width)[None, :] < lengths[:, None]).long()
        ids = torch.randint(10, 4000, (args.batch, args.width))
        ids[mask == 0] = pad_id
        share = 1 - mask.float().mean().item()
        saved = 1 - drop_padding(model, ids, mask, min_saved_share=0.0).input_ids.numel() / ids.numel()
        times = {False: [], True: []}
        step(ids, mask, False)  # warm-up
        step(ids, mask, True)
        for _ in range(args.repeats):
            for packed in (False, True):  # interleaved, so load hits both alike
                times[packed].append(step(ids, mask, packed))
        padded, packed = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {share:.3f} | {saved:.3f} | {padded:.3f} | {packed:.3f} | {packed / padded:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""SFT with two CPU processes (gloo): both ranks train one model on disjoint halves of each global batch."""

import json
import subprocess
import sys

import pytest


_SCRIPT = r"""
import hashlib, json, os, sys
import torch
from trl import SFTConfig, SFTTrainer
from trl.assets import get_model_path, load_test_dataset

out = sys.argv[1]
seen = []


class RecordingTrainer(SFTTrainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        if model.training:
            seen.append([row[row != self.processing_class.pad_token_id].tolist() for row in inputs["input_ids"]])
        return super().compute_loss(model, inputs, *args, **kwargs)


args = SFTConfig(
    output_dir=out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2, report_to="none",
    save_strategy="no", gradient_checkpointing=False, logging_steps=1, seed=0,
)
trainer = RecordingTrainer(
    model=get_model_path("tiny-Qwen2ForCausalLM"),
    args=args,
    train_dataset=load_test_dataset("standard_language_modeling", split="train"),
)
trainer.train()
digest = hashlib.sha256()
for name, param in sorted(trainer.model.named_parameters()):
    digest.update(param.detach().cpu().numpy().tobytes())
with open(os.path.join(out, f"rank{args.process_index}.json"), "w") as f:
    json.dump({"world": args.world_size, "device": str(args.device), "weights": digest.hexdigest(), "batches": seen,
               "global_batch": args.per_device_train_batch_size * args.world_size}, f)
"""


@pytest.mark.distributed
def test_sft_two_processes_share_one_model(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    code = (
        "from trl.cli.accelerate_config import resolve_accelerate_config_argument\n"
        "from trl.cli.accelerate_launcher import launch_training_script\n"
        f"launch_training_script({str(script)!r}, resolve_accelerate_config_argument(['--num_processes', '2']), "
        f"[{str(tmp_path)!r}])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]  # really two processes, not two independent runs
    assert ranks[0]["weights"] == ranks[1]["weights"]  # one model, kept in sync by DDP
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 3
    for step in range(3):
        rows0, rows1 = ranks[0]["batches"][step], ranks[1]["batches"][step]
        assert len(rows0) == len(rows1) == 2
        # the global batch is both ranks' batches together: different rows on each rank
        assert len(rows0) + len(rows1) == ranks[0]["global_batch"] == 4
        assert not any(row in rows1 for row in rows0)

"""The trained model's random initialisations (a new score head, PEFT adapters) come from `args.seed`, as in TRL:
the same seed gives the same model whatever the global generators held before."""

import torch
from datasets import Dataset
from peft import LoraConfig

from trl import RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from trl.assets import get_model_path


def _lora_a(trainer):
    return next(p for name, p in trainer.model.named_parameters() if "lora_A" in name).detach().clone()


def test_adapters_and_new_heads_follow_the_seed(tmp_path):
    path = get_model_path("tiny-Qwen2ForCausalLM")
    text = Dataset.from_dict({"text": [f"row {i} word word" for i in range(4)]})
    pairs = Dataset.from_dict({"chosen": ["a b c"] * 4, "rejected": ["a b d"] * 4})
    adapters, heads = [], []
    for run, (global_seed, seed) in enumerate([(1, 7), (2, 7), (3, 8)]):
        common = dict(max_steps=1, report_to="none", bf16=False, seed=seed)
        torch.manual_seed(global_seed)
        sft = SFTTrainer(
            path,
            args=SFTConfig(output_dir=str(tmp_path / f"sft{run}"), **common),
            train_dataset=text,
            peft_config=LoraConfig(r=4, target_modules="all-linear"),
        )
        adapters.append(_lora_a(sft))
        torch.manual_seed(global_seed)
        reward = RewardTrainer(
            path, args=RewardConfig(output_dir=str(tmp_path / f"rm{run}"), **common), train_dataset=pairs
        )
        heads.append(reward.model.score.weight.detach().clone())
    assert torch.equal(adapters[0], adapters[1]) and not torch.equal(adapters[0], adapters[2])
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])

"""Trainers, their configs, shared callbacks and training utilities (resolved lazily)."""

import sys
from typing import TYPE_CHECKING

from .._lazy_module import _LazyModule


# `judges` is a compatibility re-export of `trl.experimental.judges` (their trl 0.x import path): its names, listed
# here only so that the lazy index needs no import; `tests/experimental/test_judges.py` checks them against the real `__all__`.
_JUDGES = (
    "AllTrueJudge",
    "BaseBinaryJudge",
    "BaseJudge",
    "BasePairwiseJudge",
    "BaseRankJudge",
    "HfPairwiseJudge",
    "OpenAIPairwiseJudge",
    "PairRMJudge",
)

_import_structure = {
    "callbacks": [
        "BEMACallback",
        "LogCompletionsCallback",
        "RichProgressCallback",
        "SyncRefModelCallback",
        "WeaveCallback",
    ],
    "judges": list(_JUDGES),
    "distillation_config": ["DistillationConfig"],
    "distillation_trainer": ["DistillationTrainer"],
    "dpo_config": ["DPOConfig"],
    "dpo_trainer": ["DPOTrainer"],
    "grpo_config": ["GRPOConfig"],
    "grpo_trainer": ["GRPOTrainer"],
    "kto_config": ["KTOConfig"],
    "kto_trainer": ["KTOTrainer"],
    "model_config": ["ModelConfig"],
    "reward_config": ["RewardConfig"],
    "reward_trainer": ["RewardTrainer"],
    "rloo_config": ["RLOOConfig"],
    "rloo_trainer": ["RLOOTrainer"],
    "sft_config": ["SFTConfig"],
    "sft_trainer": ["SFTTrainer"],
    "utils": [
        "add_fused_lm_head",
        "disable_dropout_in_model",
        "ensure_master_addr_port",
        "get_kbit_device_map",
        "get_peft_config",
        "get_quantization_config",
    ],
}

if TYPE_CHECKING:
    from .callbacks import (
        BEMACallback,
        LogCompletionsCallback,
        RichProgressCallback,
        SyncRefModelCallback,
        WeaveCallback,
    )
    from .distillation_config import DistillationConfig
    from .distillation_trainer import DistillationTrainer
    from .dpo_config import DPOConfig
    from .dpo_trainer import DPOTrainer
    from .grpo_config import GRPOConfig
    from .grpo_trainer import GRPOTrainer
    from .judges import *  # noqa: F403
    from .kto_config import KTOConfig
    from .kto_trainer import KTOTrainer
    from .model_config import ModelConfig
    from .reward_config import RewardConfig
    from .reward_trainer import RewardTrainer
    from .rloo_config import RLOOConfig
    from .rloo_trainer import RLOOTrainer
    from .sft_config import SFTConfig
    from .sft_trainer import SFTTrainer
    from .utils import (
        add_fused_lm_head,
        disable_dropout_in_model,
        ensure_master_addr_port,
        get_kbit_device_map,
        get_peft_config,
        get_quantization_config,
    )
else:
    sys.modules[__name__] = _LazyModule(__name__, globals()["__file__"], _import_structure, module_spec=__spec__)

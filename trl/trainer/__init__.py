"""Trainers, their configs, shared callbacks and training utilities (resolved lazily)."""

import sys
from typing import TYPE_CHECKING

from .._lazy_module import _LazyModule


_import_structure = {
    "callbacks": [
        "BEMACallback",
        "LogCompletionsCallback",
        "RichProgressCallback",
        "SyncRefModelCallback",
        "WeaveCallback",
    ],
    "model_config": ["ModelConfig"],
    "sft_config": ["SFTConfig"],
    "sft_trainer": ["SFTTrainer"],
    "utils": [
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
    from .model_config import ModelConfig
    from .sft_config import SFTConfig
    from .sft_trainer import SFTTrainer
    from .utils import (
        disable_dropout_in_model,
        ensure_master_addr_port,
        get_kbit_device_map,
        get_peft_config,
        get_quantization_config,
    )
else:
    sys.modules[__name__] = _LazyModule(__name__, globals()["__file__"], _import_structure, module_spec=__spec__)

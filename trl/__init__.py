"""trl: post-training for transformer language models (SFT, DPO, GRPO, RLOO, KTO, reward modelling, ...).

Every public name is resolved lazily: `import trl` stays cheap and imports neither torch nor transformers until a
name that needs them is touched.
"""

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from ._lazy_module import _LazyModule


try:
    __version__ = version("trl")
except PackageNotFoundError:
    __version__ = "unknown"

_import_structure = {
    "chat_template_utils": [
        "add_response_schema",
        "clone_chat_template",
        "get_training_chat_template",
        "supports_tool_calling",
    ],
    "data_utils": [
        "apply_chat_template",
        "extract_prompt",
        "is_conversational",
        "is_conversational_from_value",
        "maybe_apply_chat_template",
        "maybe_convert_to_chatml",
        "maybe_extract_prompt",
        "maybe_unpair_preference_dataset",
        "pack_dataset",
        "prepare_multimodal_messages",
        "unpair_preference_dataset",
    ],
    "experimental.winrate_callback": ["WinRateCallback"],
    "models": ["create_reference_model"],
    "rewards": [],
    "scripts": ["DatasetMixtureConfig", "ScriptArguments", "TrlParser", "get_dataset", "init_zero_verbose"],
    "trainer": [
        "AllTrueJudge",
        "BaseBinaryJudge",
        "BaseJudge",
        "BasePairwiseJudge",
        "BaseRankJudge",
        "BEMACallback",
        "DistillationConfig",
        "DistillationTrainer",
        "DPOConfig",
        "DPOTrainer",
        "GRPOConfig",
        "GRPOTrainer",
        "HfPairwiseJudge",
        "KTOConfig",
        "KTOTrainer",
        "LogCompletionsCallback",
        "ModelConfig",
        "OpenAIPairwiseJudge",
        "PairRMJudge",
        "RewardConfig",
        "RewardTrainer",
        "RichProgressCallback",
        "RLOOConfig",
        "RLOOTrainer",
        "SFTConfig",
        "SFTTrainer",
        "SyncRefModelCallback",
        "WeaveCallback",
        "get_peft_config",
        "get_quantization_config",
    ],
}

if TYPE_CHECKING:
    from .chat_template_utils import (
        add_response_schema,
        clone_chat_template,
        get_training_chat_template,
        supports_tool_calling,
    )
    from .data_utils import (
        apply_chat_template,
        extract_prompt,
        is_conversational,
        is_conversational_from_value,
        maybe_apply_chat_template,
        maybe_convert_to_chatml,
        maybe_extract_prompt,
        maybe_unpair_preference_dataset,
        pack_dataset,
        prepare_multimodal_messages,
        unpair_preference_dataset,
    )
    from .experimental.winrate_callback import WinRateCallback
    from .models import create_reference_model
    from .scripts import DatasetMixtureConfig, ScriptArguments, TrlParser, get_dataset, init_zero_verbose
    from .trainer import (
        AllTrueJudge,
        BaseBinaryJudge,
        BaseJudge,
        BasePairwiseJudge,
        BaseRankJudge,
        BEMACallback,
        DistillationConfig,
        DistillationTrainer,
        DPOConfig,
        DPOTrainer,
        GRPOConfig,
        GRPOTrainer,
        HfPairwiseJudge,
        KTOConfig,
        KTOTrainer,
        LogCompletionsCallback,
        ModelConfig,
        OpenAIPairwiseJudge,
        PairRMJudge,
        RewardConfig,
        RewardTrainer,
        RichProgressCallback,
        RLOOConfig,
        RLOOTrainer,
        SFTConfig,
        SFTTrainer,
        SyncRefModelCallback,
        WeaveCallback,
        get_peft_config,
        get_quantization_config,
    )
else:
    sys.modules[__name__] = _LazyModule(
        __name__,
        globals()["__file__"],
        _import_structure,
        module_spec=__spec__,
        extra_objects={"__version__": __version__},
    )

"""Model helpers: reference models, generation unwrapping, DeepSpeed/FSDP preparation, activation offloading, selective
activation checkpointing, and the
Stable Diffusion pipelines of DDPO and AlignProp (`modeling_sd_base`, needs diffusers)."""

import sys
from typing import TYPE_CHECKING

from .._lazy_module import _LazyModule


_import_structure = {
    "activation_offloading": ["get_act_offloading_ctx_manager"],
    "modeling_sd_base": [
        "DDPOPipelineOutput",
        "DDPOSchedulerOutput",
        "DDPOStableDiffusionPipeline",
        "DefaultDDPOStableDiffusionPipeline",
        "pipeline_step",
        "pipeline_step_with_grad",
        "scheduler_step",
    ],
    "selective_activation_checkpointing": ["enable_selective_activation_checkpointing"],
    "utils": ["create_reference_model", "prepare_deepspeed", "prepare_fsdp", "unwrap_model_for_generation"],
}

if TYPE_CHECKING:
    from .activation_offloading import get_act_offloading_ctx_manager
    from .modeling_sd_base import (
        DDPOPipelineOutput,
        DDPOSchedulerOutput,
        DDPOStableDiffusionPipeline,
        DefaultDDPOStableDiffusionPipeline,
        pipeline_step,
        pipeline_step_with_grad,
        scheduler_step,
    )
    from .selective_activation_checkpointing import enable_selective_activation_checkpointing
    from .utils import create_reference_model, prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation
else:
    sys.modules[__name__] = _LazyModule(__name__, globals()["__file__"], _import_structure, module_spec=__spec__)

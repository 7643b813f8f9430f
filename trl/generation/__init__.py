"""Generation back-ends for the online trainers: the `trl vllm-serve` client and weight transfer (resolved lazily).

`vllm_worker_extension` holds the class the `trl vllm-serve` workers load by its qualified name to receive weights.

`VLLMGeneration` (the trainer-side wrapper of both vLLM modes) is exported only when vLLM is installed.
"""

import os
import sys
from typing import TYPE_CHECKING

from .._lazy_module import _LazyModule
from ..import_utils import is_vllm_available


_import_structure = {
    "vllm_client": ["VLLMClient", "parse_logprobs", "pil_to_base64", "to_openai_messages"],
    "weight_sync": ["WeightSyncGroup", "create_weight_sync_group"],
}

if is_vllm_available() and os.path.isfile(os.path.join(os.path.dirname(__file__), "vllm_generation.py")):
    _import_structure["vllm_generation"] = ["VLLMGeneration"]

if TYPE_CHECKING:
    from .vllm_client import VLLMClient, parse_logprobs, pil_to_base64, to_openai_messages
    from .vllm_generation import VLLMGeneration
    from .weight_sync import WeightSyncGroup, create_weight_sync_group
else:
    sys.modules[__name__] = _LazyModule(__name__, globals()["__file__"], _import_structure, module_spec=__spec__)

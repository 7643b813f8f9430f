"""ServerDistillation: on-policy distillation from a teacher served by vLLM that returns top-k log-probabilities.

Experimental: the API may change or be removed in any release.
"""

from .server_distillation_config import ServerDistillationConfig
from .server_distillation_trainer import ServerDistillationTrainer, build_teacher_request_inputs


__all__ = ["ServerDistillationConfig", "ServerDistillationTrainer", "build_teacher_request_inputs"]

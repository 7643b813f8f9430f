"""MiniLLM: knowledge distillation of a teacher into a student by reverse-KL policy optimisation (from TRL 1.12).

Experimental: the API may change or be removed in any release.
"""

from .minillm_config import MiniLLMConfig
from .minillm_trainer import MiniLLMTrainer


__all__ = ["MiniLLMConfig", "MiniLLMTrainer"]

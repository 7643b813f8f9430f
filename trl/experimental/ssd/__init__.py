"""Simple Self-Distillation (SSD): fine-tuning a model on its own sampled completions.

Experimental: the API may change or be removed in any release.
"""

from .ssd_config import SSDConfig
from .ssd_trainer import SSDTrainer


__all__ = ["SSDConfig", "SSDTrainer"]

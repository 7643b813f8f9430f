"""DDPO (Denoising Diffusion Policy Optimization) for Stable Diffusion pipelines; needs `pip install trl[diffusers]`.

Experimental: the API may change or be removed in any release.
"""

from .ddpo_config import DDPOConfig
from .ddpo_trainer import DDPOTrainer
from .stat_tracker import PerPromptStatTracker


__all__ = ["DDPOConfig", "DDPOTrainer", "PerPromptStatTracker"]

"""AlignProp (reward backpropagation) for Stable Diffusion pipelines; needs `pip install trl[diffusers]`.

Experimental: the API may change or be removed in any release.
"""

from .alignprop_config import AlignPropConfig
from .alignprop_trainer import AlignPropTrainer


__all__ = ["AlignPropConfig", "AlignPropTrainer"]

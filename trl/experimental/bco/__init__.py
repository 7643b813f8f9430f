"""Binary Classifier Optimization (BCO), with optional Underlying Distribution Matching (UDM).

Experimental: the API may change or be removed in any release. UDM needs scikit-learn and joblib (`pip install
trl[bco]`).
"""

from .bco_config import BCOConfig
from .bco_trainer import BCOTrainer


__all__ = ["BCOConfig", "BCOTrainer"]

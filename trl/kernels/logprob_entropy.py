"""TRL's module for the one-pass selected-token log-probability and entropy over materialised logits.

TRL ships a Triton kernel here (importable only where Triton is); this project's implementation is the chunked
PyTorch one of `trl.kernels.log_softmax`, which runs on every device, so the module imports everywhere.
"""

from .log_softmax import selective_log_softmax_and_entropy


__all__ = ["selective_log_softmax_and_entropy"]

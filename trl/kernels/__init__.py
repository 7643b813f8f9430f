"""Memory-efficient kernels for log-probabilities and divergences over large vocabularies (resolved lazily: importing
the package does not import torch).

TRL's modules: `chunked_logprob` (`ChunkedLogProbFunction`), `chunked_divergence` (`ChunkedDivergenceFunction`) and
`logprob_entropy` (`selective_log_softmax_and_entropy`); this project's: `log_softmax`, `linear_log_softmax`.
"""

import sys
from typing import TYPE_CHECKING

from .._lazy_module import _LazyModule


_import_structure = {
    "chunked_divergence": ["ChunkedDivergenceFunction"],
    "chunked_logprob": ["ChunkedLogProbFunction"],
    "logprob_entropy": [],
    "linear_log_softmax": ["linear_selective_log_softmax"],
    "log_softmax": ["entropy_from_logits", "selective_log_softmax", "selective_log_softmax_and_entropy"],
}

if TYPE_CHECKING:
    from .chunked_divergence import ChunkedDivergenceFunction
    from .chunked_logprob import ChunkedLogProbFunction
    from .linear_log_softmax import linear_selective_log_softmax
    from .log_softmax import entropy_from_logits, selective_log_softmax, selective_log_softmax_and_entropy
else:
    sys.modules[__name__] = _LazyModule(__name__, globals()["__file__"], _import_structure, module_spec=__spec__)

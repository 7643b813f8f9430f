"""Former (trl 0.x) location of the judges; they now live in `trl.experimental.judges`, re-exported here unchanged.

Compatibility re-export: the one deliberate import from `trl.trainer` up into `trl.experimental` (allowed by name in
`tests/test_package.py`). The names come from `trl.experimental.judges.__all__`; `trl/trainer/__init__.py` lists them
once more for its lazy index, and `tests/experimental/test_judges.py` checks that both lists agree.
"""

from ..experimental.judges import *  # noqa: F403  (compatibility re-export)
from ..experimental.judges import __all__  # noqa: F401
from ..experimental.judges.judges import DEFAULT_PAIRWISE_SYSTEM_PROMPT  # noqa: F401

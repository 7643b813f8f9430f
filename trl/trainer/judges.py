"""Former (trl 0.x) location of the judges; they now live in `trl.experimental.judges`, re-exported here unchanged."""

from ..experimental.judges import (
    AllTrueJudge,
    BaseBinaryJudge,
    BaseJudge,
    BasePairwiseJudge,
    BaseRankJudge,
    HfPairwiseJudge,
    OpenAIPairwiseJudge,
    PairRMJudge,
)
from ..experimental.judges.judges import DEFAULT_PAIRWISE_SYSTEM_PROMPT  # noqa: F401


__all__ = [
    "AllTrueJudge",
    "BaseBinaryJudge",
    "BaseJudge",
    "BasePairwiseJudge",
    "BaseRankJudge",
    "HfPairwiseJudge",
    "OpenAIPairwiseJudge",
    "PairRMJudge",
]

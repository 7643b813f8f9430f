"""Judges that compare or grade completions (pairwise, rank and binary), for online preference training and win-rate
evaluation. See `trl.experimental.judges.judges` for the implementations."""

from .judges import (
    DEFAULT_PAIRWISE_SYSTEM_PROMPT,
    AllTrueJudge,
    BaseBinaryJudge,
    BaseJudge,
    BasePairwiseJudge,
    BaseRankJudge,
    HfPairwiseJudge,
    OpenAIPairwiseJudge,
    PairRMJudge,
)


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

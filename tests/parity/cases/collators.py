"""Parity cases: Public collators: batch keys, shapes and values."""

from __future__ import annotations

from functools import partial

from . import (
    register,
    to_jsonable,
)


# ---------------------------------------------------------------------------------------------------------------------
# Public collators: batch keys, shapes and values
# ---------------------------------------------------------------------------------------------------------------------
def _batch(batch) -> dict:
    import torch

    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype), "values": to_jsonable(v)}
        if isinstance(v, torch.Tensor)
        else {"type": type(v).__name__, "value": to_jsonable(v)}
        for k, v in batch.items()
    }


_LM_EXAMPLES = [
    {"input_ids": [1, 2, 3]},
    {"input_ids": [4, 5]},
    {"input_ids": [6, 7, 8, 9]},
]
_LM_EXAMPLES_MASKED = [
    {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]},
    {"input_ids": [4, 5], "completion_mask": [0, 1]},
]


def lm_collator_case(ctx, examples=None, **kwargs) -> dict:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(pad_token_id=0, **kwargs)
    return _batch(collator(examples or _LM_EXAMPLES))


register("collators/lm/default", lm_collator_case)
register("collators/lm/padding_free", partial(lm_collator_case, padding_free=True))
register("collators/lm/return_position_ids", partial(lm_collator_case, return_position_ids=True))
register("collators/lm/pad_to_multiple_of=8", partial(lm_collator_case, pad_to_multiple_of=8))
register("collators/lm/completion_mask", partial(lm_collator_case, examples=_LM_EXAMPLES_MASKED))
register(
    "collators/lm/seq_lengths",
    partial(lm_collator_case, examples=[{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]}], padding_free=True),
)


_PREF_EXAMPLES = [
    {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
    {"prompt_ids": [7], "chosen_ids": [8], "rejected_ids": [9, 10, 11]},
]


def dpo_collator_case(ctx, **kwargs) -> dict:
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    return _batch(DataCollatorForPreference(pad_token_id=0, **kwargs)(_PREF_EXAMPLES))


register("collators/dpo/default", dpo_collator_case)
register("collators/dpo/max_length=3", partial(dpo_collator_case, max_length=3))
register("collators/dpo/max_length=3/keep_end", partial(dpo_collator_case, max_length=3, truncation_mode="keep_end"))
register("collators/dpo/pad_to_multiple_of=4", partial(dpo_collator_case, pad_to_multiple_of=4))


def reward_collator_case(ctx, margin: bool = False) -> dict:
    from trl.trainer.reward_trainer import DataCollatorForPreference

    examples = [
        {"chosen_ids": [1, 2, 3], "rejected_ids": [4, 5]},
        {"chosen_ids": [6], "rejected_ids": [7, 8, 9, 10]},
    ]
    if margin:
        examples = [{**e, "margin": m} for e, m in zip(examples, [0.5, 1.5])]
    return _batch(DataCollatorForPreference(pad_token_id=0)(examples))


register("collators/reward/default", reward_collator_case)
register("collators/reward/margin", partial(reward_collator_case, margin=True))


def kto_collator_case(ctx, examples) -> dict:
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    return _batch(DataCollatorForUnpairedPreference(pad_token_id=0)(examples))


register(
    "collators/kto/kl_and_reference",
    partial(
        kto_collator_case,
        examples=[
            {
                "prompt_ids": [1, 2],
                "completion_ids": [3],
                "label": True,
                "KL_completion_ids": [5, 6, 7],
                "ref_logps": -1.5,
                "ref_KL_logps": -4.0,
            },
            {
                "prompt_ids": [4],
                "completion_ids": [5, 6, 7],
                "label": False,
                "KL_completion_ids": [3],
                "ref_logps": -2.5,
                "ref_KL_logps": -3.0,
            },
        ],
    ),
)
register(
    "collators/kto/default",
    partial(
        kto_collator_case,
        examples=[
            {"prompt_ids": [1, 2], "completion_ids": [3], "label": True},
            {"prompt_ids": [4], "completion_ids": [5, 6, 7], "label": False},
        ],
    ),
)


# ---------------------------------------------------------------------------------------------------------------------

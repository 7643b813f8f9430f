"""Parity cases: Deliberate deviations (listed in known_divergences.DELIBERATE_DEVIATIONS and docs/parity.md)."""

from __future__ import annotations

from . import (
    case,
    expect_error,
)


# ---------------------------------------------------------------------------------------------------------------------
# Deliberate deviations (listed in known_divergences.DELIBERATE_DEVIATIONS and docs/parity.md)
# ---------------------------------------------------------------------------------------------------------------------
@case("deviations/bf16_default_on_cpu")
def _bf16_default_on_cpu(ctx):
    from trl import SFTConfig

    return {"default": expect_error(lambda: SFTConfig(output_dir=ctx.tmpdir(), report_to="none").bf16)}


@case("sft/bf16_default_with_use_cpu")
def _bf16_default_with_use_cpu(ctx):
    """With `use_cpu=True`, `bf16=None` resolves as in TRL: CPU bfloat16 autocast, for every config."""
    from trl import DPOConfig, GRPOConfig, SFTConfig

    return {
        config.__name__: expect_error(
            lambda config=config: config(output_dir=ctx.tmpdir(), report_to="none", use_cpu=True).bf16
        )
        for config in (SFTConfig, DPOConfig, GRPOConfig)
    }

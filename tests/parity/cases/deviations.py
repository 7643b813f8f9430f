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

    return {
        "default": expect_error(lambda: SFTConfig(output_dir=ctx.tmpdir(), report_to="none").bf16),
        "use_cpu": expect_error(lambda: SFTConfig(output_dir=ctx.tmpdir(), report_to="none", use_cpu=True).bf16),
    }

"""Experimental trainers and utilities. Their APIs may change or be removed in any release.

Importing this package emits `TRLExperimentalWarning` once, unless the environment variable
`TRL_EXPERIMENTAL_SILENCE` is set to a non-empty value.
"""

import warnings

from ..import_utils import TRLExperimentalWarning, is_experimental_warning_silenced


if not is_experimental_warning_silenced():
    warnings.warn(
        "You are importing from 'trl.experimental'. APIs here are experimental and may change or be removed at any "
        "time without prior notice. Set the environment variable TRL_EXPERIMENTAL_SILENCE=1 to silence this warning.",
        TRLExperimentalWarning,
        stacklevel=2,
    )

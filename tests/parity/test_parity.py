"""Parity against real TRL 1.16: one test per case in cases/, comparing the two workers' outputs (compare.py).

Run with `make test-parity` (builds `.venv-parity` first); `pytest -m parity tests/parity -k dpo` runs a subset (only
the selected cases are executed by the workers). See docs/parity.md.
"""

import pytest
from cases import CASES
from compare import compare
from known_divergences import DELIBERATE_DEVIATIONS, KNOWN_DIVERGENCES


pytestmark = pytest.mark.parity


def _params():
    for name in CASES:
        marks = ()
        if name in KNOWN_DIVERGENCES:
            marks = pytest.mark.xfail(strict=True, reason=f"known divergence: {KNOWN_DIVERGENCES[name]}")
        elif name in DELIBERATE_DEVIATIONS:
            marks = pytest.mark.xfail(strict=True, reason=f"deliberate deviation: {DELIBERATE_DEVIATIONS[name]}")
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_parity(case, parity_outputs, record_property):
    real, ours = parity_outputs.get(case)
    result = compare(real, ours, CASES[case].phrases)
    record_property("parity_kind", result.kind)
    record_property("parity_numbers_match", result.numbers_match)
    if not result.matches:
        pytest.fail(f"{case}: differs from TRL {CASES[case].oracle}\n" + "\n".join(result.problems()), pytrace=False)


def test_known_divergences_name_existing_cases():
    listed = set(KNOWN_DIVERGENCES) | set(DELIBERATE_DEVIATIONS)
    assert not sorted(listed - set(CASES)), "known_divergences.py lists cases that do not exist"
    assert not set(KNOWN_DIVERGENCES) & set(DELIBERATE_DEVIATIONS), "a case is both a known divergence and deliberate"

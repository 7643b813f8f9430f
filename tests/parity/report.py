"""Summarise a parity run: per-group pass counts (the table of docs/parity.md) and one line per differing case.

    PARITY_OUT_DIR=/tmp/parity make test-parity
    python tests/parity/report.py /tmp/parity            # markdown table + per-case lines
    python tests/parity/report.py /tmp/parity --known    # entries for known_divergences.py

Reads `ours.json` and the real-TRL outputs written by the workers (see conftest.py): `real.json` (1.16) and
`real-112.json` (1.12, the experimental trainers' oracle), whichever exist.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from cases import CASES
from compare import compare
from known_divergences import DELIBERATE_DEVIATIONS, KNOWN_DIVERGENCES


def main(out_dir: str, known: bool = False) -> int:
    real = {}
    for path in sorted(Path(out_dir).glob("real*.json")):
        real.update(json.loads(path.read_text())["cases"])
    ours = json.loads((Path(out_dir) / "ours.json").read_text())["cases"]
    counts: dict[str, Counter] = defaultdict(Counter)
    lines = []
    for name in CASES:
        if name not in real or name not in ours:
            continue
        result = compare(real[name]["output"], ours[name]["output"], CASES[name].phrases)
        group = CASES[name].group
        counts[group]["cases"] += 1
        counts[group][result.kind if result.kind in ("match", "keys") else "values"] += 1
        counts[group]["numbers"] += result.numbers_match
        if not result.matches:
            tag = "deliberate" if name in DELIBERATE_DEVIATIONS else "known" if name in KNOWN_DIVERGENCES else "NEW"
            if known:
                issue = (
                    "issue 30" if group in ("grpo", "rloo") and "completion_ids" in str(result.groups) else "issue 18"
                )
                lines.append(f"    {name!r}: {result.summary() + f' ({issue})'!r},")
            else:
                lines.append(f"- `{name}` ({tag}, {result.kind}): {result.summary()}")
    if known:
        print("\n".join(lines))
        return 0
    print("| group | cases | match | differ: keys only | differ: values / raises | numbers on shared keys match |")
    print("|---|---:|---:|---:|---:|---:|")
    total = Counter()
    for group, c in counts.items():
        total += c
        print(f"| {group} | {c['cases']} | {c['match']} | {c['keys']} | {c['values']} | {c['numbers']} |")
    print(
        f"| **all** | {total['cases']} | {total['match']} | {total['keys']} | {total['values']} | {total['numbers']} |"
    )
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sys.exit(main(args[0] if args else ".", known="--known" in sys.argv))

"""Run every benchmark in this folder (`make bench`), one after another, printing their tables.

Usage: `python benchmarks/run_all.py [name ...]` where a name is a file stem without `bench_` (e.g. `sft dpo`).
"""

import subprocess
import sys

import _harness


def main() -> int:
    wanted = set(sys.argv[1:])
    failures = 0
    for name, path in _harness.benchmark_scripts().items():
        if wanted and name not in wanted:
            continue
        print(f"\n=== {name} ===", flush=True)
        failures += subprocess.run([sys.executable, path]).returncode != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

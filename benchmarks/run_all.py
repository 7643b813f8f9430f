"""Run every benchmark in this folder (`make bench`), one after another, printing their tables.

Usage: `python benchmarks/run_all.py [name ...]` where a name is a file stem without `bench_` (e.g. `sft dpo`).
"""

import glob
import os
import subprocess
import sys


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    wanted = set(sys.argv[1:])
    failures = 0
    for path in sorted(glob.glob(os.path.join(here, "bench_*.py"))):
        name = os.path.basename(path)[len("bench_") : -len(".py")]
        if wanted and name not in wanted:
            continue
        print(f"\n=== {name} ===", flush=True)
        failures += subprocess.run([sys.executable, path]).returncode != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

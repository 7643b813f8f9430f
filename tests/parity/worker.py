"""Run a list of parity cases in one process and write their outputs as JSON.

    python tests/parity/worker.py --cases a,b,c --assets assets.json --trl-root DIR --out out.json [--trl-version V]

Started by `conftest.py` once per oracle (`.venv-parity/bin/python` for real TRL 1.16, `.venv-parity-112/bin/python`
for 1.12, each with its own cases) and once with this project's python (this project's `trl` on PYTHONPATH, every
case). Run it by file path from a scratch directory, so no `trl/` package in the working
directory shadows the one the side is meant to import; `--trl-root` names the directory the imported `trl` must live
in, and `--trl-version` the version it must have; the worker refuses to run otherwise. Each case runs isolated: an exception it raises becomes its output
(`{"__exception__": {...}}`). The JSON file is rewritten after every case, so a crash keeps the earlier results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback


class Ctx:
    """What a case gets: asset paths, fresh scratch directories and the tiny datasets."""

    def __init__(self, assets: dict[str, str], scratch: str):
        self.assets = assets
        self.scratch = scratch
        self._count = 0

    def model(self, name: str) -> str:
        return self.assets[f"models/{name}"]

    def tokenizer(self, name: str) -> str:
        return self.assets[f"tokenizers/{name}"]

    def tmpdir(self) -> str:
        self._count += 1
        path = os.path.join(self.scratch, f"d{self._count}")
        os.makedirs(path)
        return path

    def dataset(self, name: str, split: str, n: int | None = None):
        from datasets import load_dataset

        path = self.assets[f"datasets/{name}"]
        ds = load_dataset(
            "json",
            data_files={split: os.path.join(path, f"{split}.jsonl")},
            split=split,
            cache_dir=os.path.join(self.scratch, "hf_datasets_cache"),
        )
        return ds.select(range(min(n, len(ds)))) if n is not None else ds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", required=True, help="comma-separated case names")
    parser.add_argument("--assets", required=True, help="JSON file: '<kind>/<name>' -> local asset directory")
    parser.add_argument("--trl-root", required=True, help="directory the imported `trl` package must lie in")
    parser.add_argument("--out", required=True, help="output JSON file")
    parser.add_argument("--trl-version", help="the version the imported `trl` must have (an oracle's venv)")
    parser.add_argument(
        "--tracebacks",
        action="store_true",
        help="record the traceback of a failing case (this project's side only: real TRL is compared by its outputs)",
    )
    args = parser.parse_args()

    import trl

    trl_dir = os.path.realpath(os.path.dirname(trl.__file__))
    expected = os.path.realpath(args.trl_root)
    if os.path.dirname(trl_dir) != expected:
        print(f"worker: imported trl from {trl_dir}, expected it under {expected}", file=sys.stderr)
        return 3
    from importlib.metadata import version

    if args.trl_version and version("trl") != args.trl_version:
        print(f"worker: imported trl {version('trl')}, expected {args.trl_version}", file=sys.stderr)
        return 3

    import torch
    from transformers import set_seed

    torch.set_num_threads(1)
    import cases  # the worker's own directory is first on sys.path

    with open(args.assets) as f:
        assets = json.load(f)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in cases.CASES]
    if unknown:
        print(f"worker: unknown cases {unknown}", file=sys.stderr)
        return 2

    results = {
        "meta": {
            "trl_file": trl.__file__,
            "versions": {p: version(p) for p in ("trl", "torch", "transformers", "accelerate", "datasets", "peft")},
        },
        "cases": {},
    }
    scratch_root = tempfile.mkdtemp(prefix="trl-parity-")
    try:
        for name in names:
            scratch = os.path.join(scratch_root, f"case{len(results['cases'])}")
            os.makedirs(scratch)
            set_seed(0)
            start = time.perf_counter()
            try:
                output = cases.CASES[name].fn(Ctx(assets, scratch))
            except Exception as exc:  # noqa: BLE001 - recorded as the case's output
                output = {"__exception__": cases.exception_record(exc)}
                if args.tracebacks:
                    output["__exception__"]["traceback"] = traceback.format_exc().strip().splitlines()[-12:]
            results["cases"][name] = {"output": output, "seconds": round(time.perf_counter() - start, 2)}
            shutil.rmtree(scratch, ignore_errors=True)
            tmp_out = args.out + ".tmp"
            with open(tmp_out, "w") as f:
                json.dump(results, f)
            os.replace(tmp_out, args.out)
    finally:
        shutil.rmtree(scratch_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Session fixture of the parity suite: run the selected cases under real TRL and under this project, once each.

The worker processes (tests/parity/worker.py) run in parallel from a scratch working directory:

- real TRL, one worker per oracle a selected case names (`Case.oracle`): `.venv-parity/bin/python` for 1.16 (built by
  `make parity-env`, `PARITY_VENV` overrides it), `.venv-parity-112/bin/python` for 1.12 (`make parity-env-112`,
  `PARITY_VENV_112`), `.venv-parity-15/bin/python` for 1.5 (`make parity-env-15`, `PARITY_VENV_15`), each with only
  its own cases; no PYTHONPATH, user site disabled; the worker checks that `trl`
  comes from that venv's site-packages and has the oracle's version;
- this project: the current python with PYTHONPATH set to this checkout, every case; the worker checks `trl` comes
  from here.

Asset paths are resolved here, with this project's `trl.assets` (real TRL has none), in a dedicated cache
(`TRL_ASSETS_CACHE`, default `.trl-assets-parity/`), and passed to both workers as a JSON file.
Set `PARITY_OUT_DIR` to keep the workers' JSON outputs (`real.json` for 1.16, `real-112.json` for 1.12, `ours.json`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest


HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# Oracle (a key of cases.ORACLES) -> (venv, make target building it, output file tag)
ORACLE_VENVS = {
    "1.16": (Path(os.environ.get("PARITY_VENV", REPO / ".venv-parity")), "parity-env", "real"),
    "1.12": (Path(os.environ.get("PARITY_VENV_112", REPO / ".venv-parity-112")), "parity-env-112", "real-112"),
    "1.5": (Path(os.environ.get("PARITY_VENV_15", REPO / ".venv-parity-15")), "parity-env-15", "real-15"),
    "0.22": (Path(os.environ.get("PARITY_VENV_022", REPO / ".venv-parity-022")), "parity-env-022", "real-022"),
}
WORKER_TIMEOUT_S = int(os.environ.get("PARITY_WORKER_TIMEOUT", "1500"))

MODELS = (
    "tiny-Qwen2ForCausalLM",
    "tiny-Qwen2ForSequenceClassification",
    "tiny-LlamaForCausalLM",
    "tiny-LlamaForSequenceClassification",
    "small-Qwen2ForCausalLM",  # distillation teacher (same tokenizer and vocabulary as tiny-Qwen2)
    "tiny-T5ForConditionalGeneration",
    # vision-language layouts (tests/parity/cases/vlm.py)
    "tiny-Qwen2VLForConditionalGeneration",
    "tiny-LlavaForConditionalGeneration",
    "tiny-Idefics3ForConditionalGeneration",
    "tiny-Qwen2ForTokenClassification",
)
TOKENIZERS = ("qwen2_5", "llama3")


def _resolve_assets() -> dict[str, str]:
    os.environ.setdefault("TRL_ASSETS_CACHE", str(REPO / ".trl-assets-parity"))
    import trl.assets as assets

    if Path(assets.__file__).resolve().parent.parent != REPO:
        raise RuntimeError(f"trl.assets imported from {assets.__file__}, not from this checkout ({REPO})")
    paths = {f"tokenizers/{n}": assets.get_tokenizer_path(n) for n in TOKENIZERS}
    paths.update({f"models/{n}": assets.get_model_path(n) for n in MODELS})
    paths.update({f"datasets/{n}": assets.get_dataset_path(n) for n in assets.DATASET_NAMES})
    if importlib.util.find_spec("diffusers") is not None:  # the DDPO / AlignProp cases' pipeline
        paths.update(
            {f"pipelines/{n}": assets.get_diffusion_pipeline_path(n) for n in assets.DIFFUSION_PIPELINE_NAMES}
        )
    return paths


def _worker_env(scratch: Path, pythonpath: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(scratch / "hf_home"),
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        TRL_EXPERIMENTAL_SILENCE="1",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONHASHSEED="0",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONNOUSERSITE="1",
    )
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


class ParityOutputs:
    """Both sides' outputs: `real` maps an oracle to its worker's results, `problems` an oracle that could not run
    (its venv is missing) to the reason, `logs` a side to the end of its stderr."""

    def __init__(self, real: dict[str, dict], ours: dict, logs: dict[str, str], problems: dict[str, str]):
        self.real, self.ours, self.logs, self.problems = real, ours, logs, problems

    def get(self, name: str) -> tuple[dict, dict]:
        from cases import CASES

        oracle = CASES[name].oracle
        if oracle in self.problems:
            pytest.fail(self.problems[oracle], pytrace=False)
        for side, result in ((f"real TRL {oracle}", self.real[oracle]), ("this project", self.ours)):
            if name not in result.get("cases", {}):
                pytest.fail(
                    f"the {side} worker produced no output for {name!r}; its stderr ends with:\n{self.logs[side]}"
                )
        return self.real[oracle]["cases"][name]["output"], self.ours["cases"][name]["output"]


def _site_packages(python: Path, env: dict[str, str]) -> str:
    return subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout.strip()


@pytest.fixture(scope="session")
def parity_outputs(request) -> ParityOutputs:
    from cases import CASES, ORACLES

    names = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "case" in callspec.params and callspec.params["case"] not in names:
            names.append(callspec.params["case"])

    out_dir = Path(os.environ.get("PARITY_OUT_DIR") or tempfile.mkdtemp(prefix="trl-parity-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    assets_file = out_dir / "assets.json"
    assets_file.write_text(json.dumps(_resolve_assets(), indent=1))

    # side -> (python, trl root, PYTHONPATH, output tag, cases, trl version)
    sides, problems = {}, {}
    for oracle, (venv, target, tag) in ORACLE_VENVS.items():
        oracle_cases = [n for n in names if CASES[n].oracle == oracle]
        if not oracle_cases:
            continue
        python = venv / "bin" / "python"
        if not python.exists():
            problems[oracle] = f"{python} is missing: build the real-TRL {oracle} environment with `make {target}`"
            continue
        root = _site_packages(python, _worker_env(out_dir, None))
        sides[f"real TRL {oracle}"] = (str(python), root, None, tag, oracle_cases, ORACLES[oracle])
    sides["this project"] = (sys.executable, str(REPO), str(REPO), "ours", names, None)

    procs = {}
    for side, (python, trl_root, pythonpath, tag, side_cases, trl_version) in sides.items():
        scratch = Path(tempfile.mkdtemp(prefix=f"trl-parity-{tag}-"))
        cmd = [
            python,
            str(HERE / "worker.py"),
            "--cases",
            ",".join(side_cases),
            "--assets",
            str(assets_file),
            "--trl-root",
            trl_root,
            "--out",
            str(out_dir / f"{tag}.json"),
        ]
        if trl_version:
            cmd += ["--trl-version", trl_version]
        if tag == "ours":
            cmd.append("--tracebacks")
        stderr = open(out_dir / f"{tag}.stderr", "w")  # noqa: SIM115 - closed after the process ends
        procs[side] = (
            subprocess.Popen(cmd, cwd=scratch, env=_worker_env(scratch, pythonpath), stdout=stderr, stderr=stderr),
            stderr,
            tag,
        )

    start = time.monotonic()
    results, logs = {}, {}
    for side, (proc, stderr, tag) in procs.items():
        try:
            rc = proc.wait(timeout=max(1, WORKER_TIMEOUT_S - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        stderr.close()
        log = (out_dir / f"{tag}.stderr").read_text()
        logs[side] = log[-4000:]
        out_file = out_dir / f"{tag}.json"
        results[side] = json.loads(out_file.read_text()) if out_file.exists() else {"cases": {}}
        if rc != 0 and not results[side]["cases"]:
            pytest.fail(f"the {side} worker exited with {rc}:\n{logs[side]}")
    request.config._parity_timing = {
        side: sum(c["seconds"] for c in r["cases"].values()) for side, r in results.items()
    }
    real = {oracle: results.get(f"real TRL {oracle}", {"cases": {}}) for oracle in ORACLE_VENVS}
    return ParityOutputs(real, results["this project"], logs, problems)


# ---------------------------------------------------------------------------------------------------------------------
# Per-group summary at the end of the run (the table in docs/parity.md)
# ---------------------------------------------------------------------------------------------------------------------
_OUTCOMES: dict[str, Counter] = defaultdict(Counter)


def pytest_runtest_logreport(report):
    if "test_parity[" not in report.nodeid:
        return
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    name = report.nodeid.split("test_parity[", 1)[1][:-1]
    counts = _OUTCOMES[name.split("/", 1)[0]]
    props = dict(report.user_properties)
    kind = props.get("parity_kind")
    counts["cases"] += 1
    counts["numbers match"] += bool(props.get("parity_numbers_match"))
    if kind == "match":
        counts["match"] += 1
    elif kind == "keys":
        counts["keys only"] += 1
    else:
        counts["values/raises"] += 1
    if hasattr(report, "wasxfail"):
        counts["xfail" if report.outcome == "skipped" else "xpass"] += 1
    elif report.outcome == "failed":
        counts["xpass" if "XPASS(strict)" in str(report.longrepr) else "failed"] += 1


def pytest_terminal_summary(terminalreporter, config):
    if not _OUTCOMES:
        return
    columns = ["cases", "match", "keys only", "values/raises", "numbers match", "xfail", "failed", "xpass"]
    terminalreporter.section(
        "parity against real TRL (1.16; 1.12 / 1.5 for the experimental trainers they alone ship), per group"
    )
    terminalreporter.write_line(f"{'group':<20}" + "".join(f"{c:>14}" for c in columns))
    total = Counter()
    for group in sorted(_OUTCOMES):
        total += _OUTCOMES[group]
        terminalreporter.write_line(f"{group:<20}" + "".join(f"{_OUTCOMES[group][c]:>14}" for c in columns))
    terminalreporter.write_line(f"{'all':<20}" + "".join(f"{total[c]:>14}" for c in columns))
    terminalreporter.write_line(
        "match/keys only/values: how the outputs compare; numbers match: all shared values agree (column names "
        "aside); xfail: listed in known_divergences.py; failed: a new divergence; xpass: a listed case now matches "
        "(remove its entry)."
    )
    timing = getattr(config, "_parity_timing", None)
    if timing:
        terminalreporter.write_line("time in cases: " + ", ".join(f"{k} {v:.0f}s" for k, v in timing.items()))

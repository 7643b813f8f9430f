"""Scaffolding shared by the benchmark scripts in this folder.

Every benchmark measures one configuration per fresh interpreter, so that the peak resident memory (`ru_maxrss`) of a
configuration is not inflated by the ones before it: the parent process re-runs its own script with a hidden flag
(`--_one MODEL CONFIG`, `--worker NAME`, ...), the child prints its result as a JSON line, and the parent collects the
rows and prints a table. This module holds that driver and the pieces the scripts have in common: offline set-up,
the common command-line flags, a step timer, peak RSS, the prompts and reward of the online-trainer benchmarks, and
markdown tables.

The scripts are run as `python benchmarks/bench_x.py`, which puts this folder on `sys.path`, so they `import _harness`.
Only the standard library is imported at module level: the offline environment variables must be set before
transformers is first imported, and the vLLM environment's interpreter runs some of the children.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any


# The offline test models (`trl.assets.get_model_path` names) every benchmark picks from with `--models`/`--model`.
MODELS = {"tiny": "tiny-Qwen2ForCausalLM", "small": "small-Qwen2ForCausalLM"}
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))

# A table column: its title, and the row key it shows or a function of the row giving the cell (see `print_table`).
Column = tuple[str, str | Callable[[dict], Any]]
# Columns of the row entries every benchmark reports.
MODEL_COLUMNS: list[Column] = [("model", "model"), ("params (M)", "params_M")]
PEAK_RSS_COLUMN: Column = ("peak RSS (MB)", "peak_rss_MB")


# ---------------------------------------------------------------------------------------------------------------------
# Child-process set-up and measurements
# ---------------------------------------------------------------------------------------------------------------------


def setup_offline(experimental: bool = False, quiet: bool = True) -> None:
    """Prepares a child process: no model hub access, and no transformers warnings in the output.

    Call it before anything imports transformers (the hub flag is read at import time).

    Args:
        experimental (`bool`, *optional*, defaults to `False`):
            Also silence the warning printed on importing `trl.experimental` modules.
        quiet (`bool`, *optional*, defaults to `True`):
            Set the transformers logging verbosity to errors only.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_LOG_TIMING", "1")  # the online trainers' `timing/*` metrics (off in normal runs)
    if experimental:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()


def peak_rss_mb(ndigits: int | None = 1) -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports `ru_maxrss` in KiB).

    Args:
        ndigits (`int` or `None`, *optional*, defaults to `1`):
            Decimals to round to; `None` does not round.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak if ndigits is None else round(peak, ndigits)


def extra_peak_and_time(step: Callable[[], Any], repeats: int) -> dict:
    """Run `step` once to measure how far it raises the peak RSS ("extra_peak_mib"), then `repeats` more times for
    the median wall time ("time_s"). Meant for a fresh child process, whose peak is then the step's own."""
    before = peak_rss_mb(ndigits=None)
    step()
    extra = peak_rss_mb(ndigits=None) - before
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"extra_peak_mib": extra, "time_s": statistics.median(times)}


def params_millions(model: Any) -> float:
    """Number of parameters of a torch module, in millions, rounded to 0.1."""
    return round(sum(p.numel() for p in model.parameters()) / 1e6, 1)


def params_mb(model: Any | None) -> float:
    """Memory held by the parameters of a torch module (0 for `None`), in MiB, rounded to 0.1."""
    if model is None:
        return 0.0
    return round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, 1)


def warm_median(times: Sequence[float]) -> float:
    """Median of per-step times without the first one, which includes warm-up (all of them if there is only one)."""
    return statistics.median(times[1:] or times)


@functools.cache
def _step_timer_class() -> type:
    # Built on first use so that importing this module does not import transformers.
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Records the duration of every optimizer step (from `on_step_begin` to `on_step_end`) in `times`."""

        def __init__(self, clock: Callable[[], float] = time.perf_counter):
            self.clock = clock
            self.times: list[float] = []
            self._start: float | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = self.clock()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(self.clock() - self._start)

    return StepTimer


def step_timer(clock: Callable[[], float] = time.perf_counter) -> Any:
    """A `TrainerCallback` that appends the duration of each training step to its `times` list.

    Args:
        clock (`Callable[[], float]`, *optional*, defaults to `time.perf_counter`):
            The clock read at the start and end of each step, e.g. `time.process_time` for process CPU time.
    """
    return _step_timer_class()(clock)


def training_kwargs(output_dir: str, steps: int, batch_size: int, logging_steps: int | None = None) -> dict:
    """The `TrainingArguments` every benchmark shares: a fixed number of steps, no saving, reporting or progress bar.

    Args:
        output_dir (`str`):
            Where the trainer may write (nothing is saved).
        steps (`int`):
            `max_steps`.
        batch_size (`int`):
            `per_device_train_batch_size`.
        logging_steps (`int` or `None`, *optional*, defaults to `None`):
            How often to log; `None` logs once, at the last step.
    """
    return {
        "output_dir": output_dir,
        "max_steps": steps,
        "per_device_train_batch_size": batch_size,
        "logging_steps": steps if logging_steps is None else logging_steps,
        "report_to": "none",
        "save_strategy": "no",
        "gradient_checkpointing": False,
        "disable_tqdm": True,
    }


def skewed_texts() -> list[str]:
    """The texts of the length-skewed test corpus, the source of every benchmark dataset built from text."""
    from trl.assets import load_test_dataset

    return load_test_dataset("length_skewed_language_modeling", split="train")["text"]


# ---------------------------------------------------------------------------------------------------------------------
# Preference trainers (DPO, KTO)
# ---------------------------------------------------------------------------------------------------------------------


def lora_config() -> Any:
    """The LoRA adapter the PEFT configurations train: rank 16, alpha 32, on every linear layer."""
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")


def force_layout(trainer: Any, layout: str | None) -> None:
    """Overrides the batch layout of a DPO/KTO trainer (and of its reference pass, if it has one); `None` keeps it."""
    if layout is not None:
        trainer._layout = layout
        trainer._ref_layout = layout if trainer._ref_layout is not None else None


def build_preference_trainer(
    trainer_class: type,
    config_class: type,
    model_key: str,
    options: dict,
    dataset: Any,
    steps: int,
    batch_size: int,
    max_length: int,
) -> tuple[Any, Any, float]:
    """Builds a DPO-family trainer for one benchmark configuration, timing its constructor.

    Args:
        trainer_class (`type`), config_class (`type`):
            The trainer and its config class.
        model_key (`str`):
            A key of `MODELS`.
        options (`dict`):
            Config fields of the configuration, plus two benchmark-only keys: `"layout"` (forced with `force_layout`)
            and `"peft"` (train a `lora_config()` adapter, the reference being the policy with adapters disabled).
        dataset (`Any`):
            The training dataset.
        steps (`int`), batch_size (`int`), max_length (`int`):
            `max_steps`, `per_device_train_batch_size`, `max_length`.

    Returns:
        `tuple`: the trainer, its `step_timer()` callback and the constructor time in seconds (tokenization, plus the
        reference pre-pass with `precompute_ref_log_probs=True`).
    """
    from trl.assets import get_model_path

    options = dict(options)
    layout = options.pop("layout", None)
    peft_config = lora_config() if options.pop("peft", False) else None
    timer = step_timer()
    name = trainer_class.__name__.removesuffix("Trainer").lower()
    config = config_class(
        **training_kwargs(f"/tmp/bench-{name}-{model_key}", steps, batch_size),
        max_length=max_length,
        learning_rate=1e-5,
        **options,
    )
    start = time.perf_counter()
    trainer = trainer_class(
        model=get_model_path(MODELS[model_key]),
        args=config,
        train_dataset=dataset,
        callbacks=[timer],
        peft_config=peft_config,
    )
    init_s = time.perf_counter() - start
    force_layout(trainer, layout)
    return trainer, timer, init_s


def preference_row(
    trainer: Any, timer: Any, init_s: float, model_key: str, config_name: str, extra: dict | None = None
) -> dict:
    """The result row of a trained DPO-family trainer: sizes, median step time, peak RSS, constructor time.

    Args:
        trainer (`Any`), timer (`Any`), init_s (`float`):
            What `build_preference_trainer` returned, after `trainer.train()`.
        model_key (`str`), config_name (`str`):
            The `model` and `config` entries of the row.
        extra (`dict` or `None`, *optional*, defaults to `None`):
            Script-specific entries, placed after `step_s`.
    """
    return {
        "model": model_key,
        "config": config_name,
        "layout": trainer._layout,
        "params_M": params_millions(trainer.model),
        "step_s": round(warm_median(timer.times), 4),
        **(extra or {}),
        "peak_rss_MB": peak_rss_mb(),
        "init_s": round(init_s, 2),
        "ref_model_MB": params_mb(trainer.ref_model),
    }


def preference_columns(extra: Column) -> list[Column]:
    """The table columns of `preference_row` results, with the script's own `extra` column after the step time."""
    return [
        *MODEL_COLUMNS,
        ("config", "config"),
        ("layout", "layout"),
        ("step (s)", "step_s"),
        extra,
        PEAK_RSS_COLUMN,
        ("init (s)", "init_s"),
        ("ref model (MB)", "ref_model_MB"),
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Online trainers (GRPO, Online DPO, ...)
# ---------------------------------------------------------------------------------------------------------------------


# The options of `add_online_arguments` and `add_grid_arguments` that the online benchmarks pass on to their children.
ONLINE_FLAGS = ["steps", "batch_size", "prompt_tokens", "completion_tokens", "threads", "clock"]


def add_online_arguments(parser: argparse.ArgumentParser, prompt_tokens: int, completion_tokens: int) -> None:
    """Adds the options of the online benchmarks: `--prompt_tokens`, `--completion_tokens`, `--threads`, `--clock`.

    Args:
        parser (`argparse.ArgumentParser`):
            The script's parser.
        prompt_tokens (`int`), completion_tokens (`int`):
            Defaults of the prompt length (see `build_prompts`) and of the completion length, in tokens.
    """
    parser.add_argument("--prompt_tokens", type=int, default=prompt_tokens)
    parser.add_argument("--completion_tokens", type=int, default=completion_tokens)
    parser.add_argument("--threads", type=int, default=None, help="torch threads with --clock wall")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")


def apply_clock(clock: str, threads: int | None, timed_modules: Iterable[ModuleType] = ()) -> None:
    """Chooses what the trainers' timers measure in this process.

    With `clock="cpu"`, the `time.perf_counter` the given modules read is replaced by the process CPU clock and torch
    runs on one thread: on a shared machine wall times swing with the load of other processes, the CPU time of a
    single-threaded run does not. With `clock="wall"`, torch runs on `threads` threads (its default when `None`).

    Args:
        clock (`str`):
            `"cpu"` or `"wall"`.
        threads (`int` or `None`):
            torch threads with the wall clock.
        timed_modules (`Iterable[ModuleType]`, *optional*, defaults to `()`):
            Modules whose global `time` the trainers' timers go through.
    """
    import types

    import torch

    if clock == "cpu":
        cpu_clock = types.SimpleNamespace(perf_counter=time.process_time)
        for module in timed_modules:
            module.time = cpu_clock
        torch.set_num_threads(1)
    elif threads:
        torch.set_num_threads(threads)


def build_prompts(tokenizer: Any, prompt_tokens: int, count: int) -> Any:
    """`count` prompts of exactly `prompt_tokens` tokens cut from the length-skewed corpus, as a `Dataset`."""
    from datasets import Dataset

    corpus_ids = tokenizer(" ".join(skewed_texts()))["input_ids"]
    prompts = []
    for i in range(count):
        start = (i * 997) % max(1, len(corpus_ids) - prompt_tokens)
        prompts.append(tokenizer.decode(corpus_ids[start : start + prompt_tokens]))
    return Dataset.from_dict({"prompt": prompts})


def prepare_online_run(
    model_key: str, args: argparse.Namespace, timed_modules: Iterable[ModuleType]
) -> tuple[str, Any]:
    """Sets up one online-trainer run: the clock (see `apply_clock`), seed 0, the model and 64 prompts.

    Args:
        model_key (`str`):
            A key of `MODELS`.
        args (`argparse.Namespace`):
            The options of `add_online_arguments`.
        timed_modules (`Iterable[ModuleType]`):
            The modules whose `time.perf_counter` the trainers' timers read.

    Returns:
        `tuple[str, Dataset]`: the model path and the prompt dataset (see `build_prompts`).
    """
    import torch
    from transformers import AutoTokenizer

    from trl.assets import get_model_path

    apply_clock(args.clock, args.threads, timed_modules)
    torch.manual_seed(0)
    model_path = get_model_path(MODELS[model_key])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return model_path, build_prompts(tokenizer, args.prompt_tokens, 64)


def cheap_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """A reward function that costs next to nothing (share of low token ids), so that scoring does not dominate."""
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def online_step_row(trainer: Any, model_key: str, config_name: str, rate_key: str, items_per_step: int) -> dict:
    """The result row of an online-trainer run, from the `step_time` and `timing/*` values the trainer logged.

    Medians over the logged steps, the first one (warm-up) left out.

    Args:
        trainer (`Any`):
            A trained online trainer that logged every step.
        model_key (`str`), config_name (`str`):
            The `model` and `config` entries of the row.
        rate_key (`str`):
            Name of the throughput entry, `items_per_step / step time`.
        items_per_step (`int`):
            Completions (or prompt pairs) per step.
    """
    logs = [log for log in trainer.state.log_history if "step_time" in log][1:]

    def median(key: str) -> float:
        return statistics.median(log[key] for log in logs)

    step = median("step_time")
    return {
        "model": model_key,
        "config": config_name,
        "params_M": params_millions(trainer.model),
        "step_s": round(step, 3),
        "rollout_s": round(median("timing/rollout"), 3),
        "generation_s": round(median("timing/generation"), 3),
        "training_s": round(median("timing/training"), 3),
        rate_key: round(items_per_step / step, 2),
        "peak_rss_MB": peak_rss_mb(),
    }


def online_columns(rate: Column) -> list[Column]:
    """The table columns of `online_step_row` results, with the throughput column `rate` before the peak RSS."""
    return [
        *MODEL_COLUMNS,
        ("config", "config"),
        ("step (s)", "step_s"),
        ("rollout (s)", "rollout_s"),
        ("generate (s)", "generation_s"),
        ("training (s)", "training_s"),
        rate,
        PEAK_RSS_COLUMN,
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Command line and the subprocess driver
# ---------------------------------------------------------------------------------------------------------------------


def make_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose `--help` shows the script's docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_grid_arguments(
    parser: argparse.ArgumentParser,
    configs: Iterable[str],
    steps: int,
    batch_size: int,
    batch_help: str | None = None,
    configs_flag: str = "--configs",
) -> None:
    """Adds the flags of a model x configuration benchmark: `--models`, `--configs`, `--steps`, `--batch_size`.

    Also adds the hidden `--_one MODEL CONFIG` flag with which `run_grid` re-runs the script for one configuration.

    Args:
        parser (`argparse.ArgumentParser`):
            The script's parser.
        configs (`Iterable[str]`):
            The configuration names, all run by default.
        steps (`int`), batch_size (`int`):
            Defaults of `--steps` and `--batch_size`.
        batch_help (`str` or `None`, *optional*, defaults to `None`):
            Help text of `--batch_size`.
        configs_flag (`str`, *optional*, defaults to `"--configs"`):
            Name of the configuration flag (e.g. `"--layouts"`).
    """
    configs = list(configs)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(configs_flag, nargs="+", default=configs, choices=configs)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch_size", type=int, default=batch_size, help=batch_help)
    parser.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)


def forwarded_flags(args: argparse.Namespace, keys: Iterable[str], dashes: bool = False) -> list[str]:
    """`--key value` for each of `keys` whose value in `args` is not `None`, to pass the options on to a child.

    Args:
        args (`argparse.Namespace`):
            The parsed options.
        keys (`Iterable[str]`):
            Attribute names, in the order to pass them.
        dashes (`bool`, *optional*, defaults to `False`):
            Spell the flags with dashes (`--max-new-tokens` for `max_new_tokens`).
    """
    flags = []
    for key in keys:
        value = getattr(args, key)
        if value is not None:
            flags += ["--" + (key.replace("_", "-") if dashes else key), str(value)]
    return flags


class ChildFailed(RuntimeError):
    """A benchmark child process exited with an error or printed no result.

    Attributes:
        returncode (`int`): The child's exit status.
        stderr (`str`): Everything the child wrote to its standard error.
    """

    def __init__(self, message: str, returncode: int, stderr: str):
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr


def run_child(script: str, child_args: Sequence[str], python: str | None = None, marker: str = "") -> dict:
    """Runs `script` with `child_args` in a fresh interpreter and returns the JSON of its last result line.

    Args:
        script (`str`):
            The benchmark script (its `__file__`).
        child_args (`Sequence[str]`):
            Its command-line arguments.
        python (`str` or `None`, *optional*, defaults to `None`):
            The interpreter; `None` uses this one.
        marker (`str`, *optional*, defaults to `""`):
            Prefix of the result line; with `""` the last non-blank line of the output is the result.

    Raises:
        ChildFailed: when the child exits with an error or prints no result line (the message ends with the tail of
            its standard error).
    """
    command = [python or sys.executable, os.path.abspath(script), *child_args]
    process = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in process.stdout.splitlines() if line.strip() and line.startswith(marker)]
    if process.returncode != 0 or not lines:
        outcome = f"exited with code {process.returncode}" if process.returncode else "printed no result line"
        message = f"`{' '.join(command)}` {outcome}; the end of its stderr:\n{process.stderr[-2000:]}"
        raise ChildFailed(message, process.returncode, process.stderr)
    return json.loads(lines[-1][len(marker) :])


def run_grid(script: str, models: Iterable[str], configs: Iterable[str], flags: Sequence[str] = ()) -> list[dict]:
    """Runs every model x configuration of a benchmark, each in its own process, printing each row as it arrives.

    The child is `script --_one MODEL CONFIG *flags`; it must print its result row as the last line of its output.

    Args:
        script (`str`):
            The benchmark script (its `__file__`).
        models (`Iterable[str]`), configs (`Iterable[str]`):
            The keys to run, models in the outer loop.
        flags (`Sequence[str]`, *optional*, defaults to `()`):
            Options to pass on to every child (see `forwarded_flags`).

    Returns:
        `list[dict]`: the result rows, in the order they ran.
    """
    configs = list(configs)
    rows = []
    for model_key in models:
        for config_name in configs:
            rows.append(run_child(script, ["--_one", model_key, config_name, *flags]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def drive_grid(
    script: str,
    args: argparse.Namespace,
    run_one: Callable[[str, str, argparse.Namespace], dict],
    flag_keys: Iterable[str],
    configs: Iterable[str],
) -> list[dict] | None:
    """Plays the role of a model x configuration benchmark script that `args` asks for (see `add_grid_arguments`).

    In a child (`--_one MODEL CONFIG`), prints `run_one(MODEL, CONFIG, args)` as the result line and returns `None`.
    In the parent, runs every configuration of `args.models` x `configs` in a child, passing on the options
    `flag_keys`, and returns the rows (see `run_grid`).

    Args:
        script (`str`):
            The benchmark script (its `__file__`).
        args (`argparse.Namespace`):
            The parsed options.
        run_one (`Callable[[str, str, argparse.Namespace], dict]`):
            Measures one model key and configuration name in this process, with the options `args`.
        flag_keys (`Iterable[str]`):
            The options the children need (see `forwarded_flags`).
        configs (`Iterable[str]`):
            The configurations to run.
    """
    if args._one:
        print_result(run_one(*args._one, args))
        return None
    return run_grid(script, args.models, configs, forwarded_flags(args, flag_keys))


def print_result(row: dict, marker: str = "") -> None:
    """What a child prints as its result: one JSON line, after `marker`."""
    print(marker + json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Markdown tables
# ---------------------------------------------------------------------------------------------------------------------


def table_row(cells: Iterable[Any]) -> str:
    """One markdown table line: `| a | b | c |`."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def table_header(titles: Sequence[str]) -> str:
    """The two header lines of a markdown table: the titles, then the `|---|---|` separator."""
    return table_row(titles) + "\n|" + "---|" * len(titles)


def print_table(rows: Iterable[dict], columns: Sequence[Column]) -> None:
    """Prints result rows as a markdown table, after a blank line.

    Args:
        rows (`Iterable[dict]`):
            The result rows.
        columns (`Sequence[Column]`):
            Per column, its title and either the row key it shows or a function of the row giving the cell.
    """
    print("\n" + table_header([title for title, _ in columns]))
    for row in rows:
        print(table_row(cell(row) if callable(cell) else row[cell] for _, cell in columns))


def percent(key: str) -> Callable[[dict], str]:
    """A table cell showing the fraction `row[key]` as a percentage with one decimal (`0.123` -> `12.3%`)."""
    return lambda row: f"{row[key]:.1%}"


# ---------------------------------------------------------------------------------------------------------------------
# The scripts of this folder
# ---------------------------------------------------------------------------------------------------------------------


def benchmark_scripts() -> dict[str, str]:
    """The benchmarks of this folder, `{name: path}` sorted by name, a name being the file stem without `bench_`."""
    paths = sorted(glob.glob(os.path.join(BENCH_DIR, "bench_*.py")))
    return {os.path.basename(path)[len("bench_") : -len(".py")]: path for path in paths}

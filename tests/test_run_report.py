"""The run report (issue 53): `metrics.jsonl` appended as rows are logged, `report.html` after training and at each
checkpoint, self-contained; the `save_run_report` opt-out; failures only warn; `trl report` re-renders and overlays."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from html.parser import HTMLParser

import pytest
from trainer_utils import GROUP_ARGS, args_builder, low_id_reward
from transformers import TrainerCallback

import trl
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trl.assets import load_test_dataset
from trl.cli.main import main as trl_main
from trl.trainer.run_report import RunReportCallback, load_run, read_rows, write_report
from trl.trainer.run_report import page as report_page
from trl.trainer.run_report.callback import run_report_enabled
from trl.trainer.run_report.charts import select_panels
from trl.trainer.run_report.config_summary import describe_config
from trl.trainer.run_report.data_summary import length_statistics
from trl.trainer.run_report.history import RunHistory


pytestmark = pytest.mark.usefixtures("single_thread")

# Trainer tests elsewhere turn the report off (COMMON_ARGS); here it is on, as by default.
REPORT_ON = dict(save_run_report=True)
make_sft_args = args_builder(SFTConfig, max_steps=3, per_device_train_batch_size=4, max_length=32, **REPORT_ON)
make_grpo_args = args_builder(GRPOConfig, **GROUP_ARGS, **REPORT_ON)


@pytest.fixture(scope="module")
def language_modeling():
    return load_test_dataset("standard_language_modeling")


def rows_of(output_dir, row_type=None):
    rows = read_rows(os.path.join(output_dir, "metrics.jsonl"))
    return [row for row in rows if row_type is None or row["type"] == row_type]


class _PageAudit(HTMLParser):
    """Collects what a page would load: every `src`/`href` value, and the tags that pull in or run code."""

    def __init__(self):
        super().__init__()
        self.references: list[str] = []
        self.images: list[str] = []  # inline <svg> charts
        self.active_tags: list[str] = []
        self.headings: list[str] = []
        self._in_heading = False

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href") and value is not None:
                self.references.append(value)
        if tag == "svg":
            self.images.append(dict(attrs).get("aria-label", ""))
        if tag in ("script", "link", "iframe", "object", "embed", "img", "image", "use"):
            self.active_tags.append(tag)
        self._in_heading = tag == "h2"

    def handle_data(self, data):
        if self._in_heading:
            self.headings.append(data)
            self._in_heading = False


def audit_page(path) -> _PageAudit:
    audit = _PageAudit()
    with open(path, encoding="utf-8") as f:
        audit.feed(f.read())
    return audit


def assert_self_contained(path):
    """The page references nothing outside itself: charts are inline SVG, no image file, script, stylesheet link or
    frame."""
    audit = audit_page(path)
    assert not audit.active_tags, audit.active_tags
    for reference in audit.references:
        assert reference.startswith("#"), reference[:80]
    return audit


# ---------------------------------------------------------------------------------------------------------------------
# Training writes the history and the page
# ---------------------------------------------------------------------------------------------------------------------
class _ReadHistoryAtEachStep(TrainerCallback):
    """Reads metrics.jsonl when each step begins: the rows of the steps before must already be on disk."""

    def __init__(self, output_dir):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.seen: list[tuple[int, list[int]]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            return
        steps = [row["step"] for row in read_rows(self.path) if row["type"] == "log"]
        self.seen.append((state.global_step, steps))


def test_data_summary_counts_the_rows_truncated_in_preparation(tmp_path, model_path, language_modeling):
    from trl.trainer.run_report.data_summary import describe_trainer_data
    from trl.trainer.run_report.page import _data_section

    args = make_sft_args(tmp_path, max_length=8)
    trainer = SFTTrainer(
        model_path, args=args, train_dataset=language_modeling["train"], eval_dataset=language_modeling["test"]
    )
    tokenizer = trainer.processing_class
    # SFT appends EOS to each text; a row longer than max_length is cut.
    expected = sum(len(tokenizer(text)["input_ids"]) + 1 > 8 for text in language_modeling["train"]["text"])
    splits = describe_trainer_data(trainer)
    assert splits["train"]["truncated_rows"] == expected > 0
    assert splits["eval"]["truncated_rows"] > 0
    run = type("Run", (), {"name": "run", "data": splits})()
    assert f"{expected:,} rows truncated</b> to max_length" in _data_section([run])


def test_sft_rows_are_on_disk_as_logged_and_the_report_is_written(tmp_path, model_path, language_modeling):
    reader = _ReadHistoryAtEachStep(str(tmp_path))
    args = make_sft_args(tmp_path, eval_strategy="steps", eval_steps=2)
    trainer = SFTTrainer(
        model_path,
        args=args,
        train_dataset=language_modeling["train"],
        eval_dataset=language_modeling["test"],
        callbacks=[reader],
    )
    assert any(isinstance(callback, RunReportCallback) for callback in trainer.callback_handler.callbacks)
    trainer.train()

    # Mid-run, the file already held one row per finished step (logging_steps=1).
    assert reader.seen == [(1, [1]), (2, [1, 2, 2])]  # step 2 also logged its evaluation
    kinds = [row["type"] for row in rows_of(tmp_path)]
    assert kinds[:2] == ["run", "data"] and kinds[-1] == "end"
    logs = rows_of(tmp_path, "log")
    assert [row["step"] for row in logs if "loss" in row] == [1, 2, 3]
    # The last step evaluates too from transformers 5 (4.x evaluates at eval_steps multiples only).
    assert [row["step"] for row in logs if "eval_loss" in row] in ([2, 3], [2])
    assert all(isinstance(row["loss"], float) for row in logs if "loss" in row)
    run = rows_of(tmp_path, "run")[0]
    assert run["trainer"] == "SFTTrainer" and run["max_steps"] == 3
    assert "max_steps" in run["config_changed"] and "bf16" not in run["config_changed"]
    data = rows_of(tmp_path, "data")[0]
    assert data["train"]["raw_format"] == "language_modeling" and data["train"]["rows"] == 64
    assert data["train"]["token_lengths"]["input_ids"]["max_length"] == 32
    assert data["train"]["truncated_rows"] == 0 and data["train"]["rows_without_trainable_token"] == 0

    # save_strategy="no": no checkpoint, yet the page is written when training ends.
    audit = assert_self_contained(tmp_path / "report.html")
    assert {"Overview", "Curves", "All metrics", "Data", "Configuration"} <= set(audit.headings)
    page = (tmp_path / "report.html").read_text()
    assert (
        'aria-label="Loss"' in page and 'aria-label="Learning rate"' in page and 'aria-label="Gradient norm"' in page
    )
    assert "train: input_ids per row" in page  # the length histogram


def test_grpo_report_has_rewards_kl_and_sample_completions(tmp_path, model_path, prompts):
    args = make_grpo_args(tmp_path, beta=0.1, max_steps=2)
    GRPOTrainer(model_path, reward_funcs=low_id_reward, args=args, train_dataset=prompts).train()

    prompt_lengths = rows_of(tmp_path, "data")[0]["train"]["token_lengths"]["prompt"]
    assert prompt_lengths["count"] == min(len(prompts), 256) and prompt_lengths["min"] > 0
    samples = rows_of(tmp_path, "samples")
    assert samples and all(len(row["samples"]) <= 4 for row in samples)
    assert {"prompt", "completion", "low_id_reward"} <= set(samples[-1]["samples"][0])
    audit = assert_self_contained(tmp_path / "report.html")
    assert "Sample completions" in audit.headings
    page = (tmp_path / "report.html").read_text()
    assert 'aria-label="Reward"' in page and 'aria-label="KL to the reference"' in page


def test_checkpoints_are_listed_and_the_page_is_written_at_each_save(tmp_path, model_path, language_modeling):
    class _PageAtSave(TrainerCallback):
        found = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.found.append(os.path.isfile(os.path.join(args.output_dir, "report.html")))

    args = make_sft_args(tmp_path, save_strategy="steps", save_steps=2)
    trainer = SFTTrainer(model_path, args=args, train_dataset=language_modeling["train"], callbacks=[_PageAtSave()])
    trainer.train()
    assert _PageAtSave.found == [False, False, True]  # written by the save at step 2, before step 3 began
    checkpoints = rows_of(tmp_path, "checkpoint")
    assert [row["step"] for row in checkpoints] == [2, 3]
    assert checkpoints[0]["path"] == str(tmp_path / "checkpoint-2")


def test_opt_out_writes_nothing(tmp_path, model_path, language_modeling):
    args = make_sft_args(tmp_path, save_run_report=False)
    trainer = SFTTrainer(model_path, args=args, train_dataset=language_modeling["train"])
    trainer.train()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "report.html").exists()


def test_no_output_dir_means_no_report():
    class Args:
        output_dir = None
        save_run_report = True

    assert not run_report_enabled(Args())
    Args.output_dir = "out"
    assert run_report_enabled(Args())
    Args.save_run_report = False
    assert not run_report_enabled(Args())


def test_a_failing_page_only_warns(tmp_path, model_path, language_modeling, monkeypatch):
    def broken_page(runs):
        raise RuntimeError("simulated rendering bug")

    monkeypatch.setattr(report_page, "build_page", broken_page)
    trainer = SFTTrainer(model_path, args=make_sft_args(tmp_path), train_dataset=language_modeling["train"])
    with pytest.warns(RuntimeWarning, match="could not write report.html.*simulated rendering bug"):
        trainer.train()
    assert trainer.state.global_step == 3
    assert len(rows_of(tmp_path, "log")) == 4  # three steps and the run totals
    assert not (tmp_path / "report.html").exists()


def test_an_unwritable_history_warns_once(tmp_path, model_path, language_modeling):
    (tmp_path / "metrics.jsonl").mkdir()  # a directory where the file should go
    trainer = SFTTrainer(model_path, args=make_sft_args(tmp_path), train_dataset=language_modeling["train"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    messages = [str(w.message) for w in caught if "Run report" in str(w.message)]
    assert trainer.state.global_step == 3
    assert any("metrics.jsonl" in message for message in messages)
    assert len(messages) == len(set(messages)), messages  # each failure once, not at every step


def test_report_charts_need_no_plotting_library(tmp_path, model_path, language_modeling, monkeypatch):
    """The curves are drawn as SVG by the report itself: a run without matplotlib gets them all the same, and the
    page is written in well under a second."""
    import sys
    import time

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it would fail
    trainer = SFTTrainer(model_path, args=make_sft_args(tmp_path), train_dataset=language_modeling["train"])
    trainer.train()
    audit = assert_self_contained(tmp_path / "report.html")
    assert "Loss" in audit.images and "Learning rate" in audit.images
    start = time.perf_counter()
    write_report([str(tmp_path)])
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------------------------------------------------------------
# The history file: a killed run keeps its rows; a resumed run replaces the steps it logs again
# ---------------------------------------------------------------------------------------------------------------------
_KILLED_RUN = """
import os, signal, sys
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer
from trl.assets import get_model_path, load_test_dataset

class KillAtStep3(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            os.kill(os.getpid(), signal.SIGKILL)

args = SFTConfig(output_dir=sys.argv[1], max_steps=10, logging_steps=1, per_device_train_batch_size=4, max_length=32,
                 report_to="none", save_strategy="no", gradient_checkpointing=False, disable_tqdm=True)
dataset = load_test_dataset("standard_language_modeling", split="train")
SFTTrainer(get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=dataset,
           callbacks=[KillAtStep3()]).train()
"""


def test_rows_logged_before_a_kill_9_are_kept(tmp_path):
    script = tmp_path / "killed_run.py"
    script.write_text(textwrap.dedent(_KILLED_RUN))
    output_dir = tmp_path / "out"
    # The child imports the `trl` under test (this checkout), not whichever one is installed.
    root = os.path.dirname(os.path.dirname(os.path.abspath(trl.__file__)))
    pythonpath = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    result = subprocess.run([sys.executable, str(script), str(output_dir)], capture_output=True, text=True, env=env)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    # Killed after step 3 ended but before its row was logged: steps 1 and 2 are there, whole.
    assert [row["step"] for row in rows_of(output_dir, "log")] == [1, 2]
    assert not rows_of(output_dir, "end")
    # The page can still be rendered from what was left.
    assert trl_main(["report", str(output_dir)]) == 0
    assert "in progress or stopped" in (output_dir / "report.html").read_text()


def test_reader_skips_a_line_cut_short_and_a_resume_replaces_later_steps(tmp_path):
    rows = [
        {"type": "run", "time": 100.0, "step": 0, "resumed_from_step": None},
        *({"type": "log", "time": 100.0 + s, "step": s, "loss": 10.0 - s} for s in (1, 2, 3, 4)),
        {"type": "checkpoint", "time": 104.0, "step": 4, "path": "x"},
        {"type": "run", "time": 200.0, "step": 2, "resumed_from_step": 2},
        {"type": "log", "time": 201.0, "step": 3, "loss": 1.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"type": "log", "ste')
    history = RunHistory.from_rows(read_rows(str(path)), "run", str(path))
    assert history.series("loss") == ([1, 2, 3], [9.0, 8.0, 1.0])
    assert history.checkpoints == [] and history.segments == 2
    assert history.wall_time_s() == pytest.approx(101.0)


# ---------------------------------------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------------------------------------
def test_key_charts_follow_the_trainer_family():
    def panels_for(*names):
        history = RunHistory("r", "r", logs=[{"type": "log", "step": 1, **dict.fromkeys(names, 1.0)}])
        return [panel.title for panel in select_panels([history])]

    assert panels_for("loss", "learning_rate", "grad_norm", "mean_token_accuracy") == [
        "Loss",
        "Learning rate",
        "Gradient norm",
        "Token accuracy",
    ]
    preference = panels_for("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
    assert preference == ["Loss", "Preference rewards", "Reward margin", "Preference accuracy"]
    online = panels_for("loss", "reward", "kl", "rewards/a/mean", "rewards/b/mean")
    assert online == ["Loss", "Reward", "Reward per function", "KL to the reference"]


def test_config_lists_the_fields_set_by_the_user_and_hides_credentials(tmp_path):
    config = SFTConfig(output_dir=str(tmp_path), learning_rate=3e-4, hub_token="secret", report_to="none")
    changed, full = describe_config(config)
    assert {"output_dir", "learning_rate", "hub_token"} <= set(changed)
    assert "bf16" not in changed  # resolved at start-up, not set by the user
    # `report_to="none"` is transformers 5's default (so not "set"); 4.x's default is None.
    assert changed["learning_rate"] == {"value": 3e-4, "default": 2e-5}
    assert full["hub_token"] == "<hidden>" and "secret" not in json.dumps(full)
    assert list(full)[: len(changed)] == list(changed)


def test_length_statistics():
    stats = length_statistics([3, 1, 2, 10, 10], max_length=10)
    assert (stats["min"], stats["p50"], stats["max"], stats["mean"]) == (1, 3, 10, 5.2)
    assert stats["at_max_length"] == 2 and sum(stats["hist_counts"]) == 5
    assert len(stats["hist_edges"]) == len(stats["hist_counts"]) + 1


# ---------------------------------------------------------------------------------------------------------------------
# `trl report`
# ---------------------------------------------------------------------------------------------------------------------
def _fake_run(directory, losses, learning_rate):
    os.makedirs(directory, exist_ok=True)
    rows = [{"type": "run", "time": 0.0, "step": 0, "trainer": "SFTTrainer", "max_steps": len(losses)}]
    rows[0]["config_changed"] = {"learning_rate": {"value": learning_rate, "default": 2e-5}}
    rows[0]["config"] = {"learning_rate": learning_rate, "seed": 42}
    rows += [
        {"type": "log", "time": float(step), "step": step, "loss": loss, "learning_rate": learning_rate}
        for step, loss in enumerate(losses, start=1)
    ]
    rows.append({"type": "end", "time": float(len(losses)), "step": len(losses)})
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def test_trl_report_rerenders_one_run_next_to_its_history(tmp_path, capsys):
    _fake_run(tmp_path / "run-a", [3.0, 2.0, 1.5], 1e-4)
    assert trl_main(["report", str(tmp_path / "run-a")]) == 0
    assert str(tmp_path / "run-a" / "report.html") in capsys.readouterr().out
    assert_self_contained(tmp_path / "run-a" / "report.html")


def test_trl_report_overlays_several_runs(tmp_path):
    _fake_run(tmp_path / "run-a", [3.0, 2.0, 1.5], 1e-4)
    _fake_run(tmp_path / "run-b", [3.0, 2.5, 2.2, 2.0], 1e-5)
    output = tmp_path / "compare.html"
    assert trl_main(["report", str(tmp_path / "run-a"), str(tmp_path / "run-b"), "--output", str(output)]) == 0
    audit = assert_self_contained(output)
    page = output.read_text()
    assert "2 runs compared" in page
    assert page.count("<td>run-a</td>") >= 1 and page.count("<td>run-b</td>") >= 1
    assert "<b>learning_rate</b>" in page  # a field that differs between the runs comes first, in bold
    assert len(audit.images) >= 2  # loss and learning rate, each with both runs' curves


def test_trl_report_refuses_a_directory_without_history(tmp_path, capsys):
    assert trl_main(["report", str(tmp_path)]) == 2
    assert "No metrics.jsonl" in capsys.readouterr().err


def test_write_report_names_same_named_runs_by_their_parent(tmp_path):
    _fake_run(tmp_path / "a" / "out", [1.0], 1e-4)
    _fake_run(tmp_path / "b" / "out", [2.0], 1e-4)
    path = write_report([str(tmp_path / "a" / "out"), str(tmp_path / "b" / "out")], str(tmp_path / "r.html"))
    page = open(path).read()
    assert "a/out" in page and "b/out" in page
    assert load_run(str(tmp_path / "a" / "out")).name == "out"


# ---------------------------------------------------------------------------------------------------------------------
# A real browser, where one is installed
# ---------------------------------------------------------------------------------------------------------------------
_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@pytest.mark.skipif(not any(shutil.which(name) for name in _BROWSERS), reason="no Chromium/Chrome on PATH")
def test_the_page_renders_in_a_headless_browser(tmp_path):
    _fake_run(tmp_path / "run", [3.0, 2.0, 1.5], 1e-4)
    page = write_report([str(tmp_path / "run")])
    browser = next(shutil.which(name) for name in _BROWSERS if shutil.which(name))
    screenshot = tmp_path / "run" / "report.png"
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={screenshot}"]
    command += ["--window-size=1280,2000", f"file://{os.path.abspath(page)}"]
    subprocess.run(command, capture_output=True, timeout=120)
    assert screenshot.is_file() and screenshot.stat().st_size > 10_000

"""The first hour of a new user has no traps (issue 53): each mistake is refused before anything trains, with a
message that says what to change, and a `trl` run ends on a line that says where everything went."""

import logging
import os
import subprocess
import sys
import warnings

import pytest
from trainer_utils import GROUP_ARGS, args_builder

import trl
from trl import GRPOConfig, GRPOTrainer, SFTConfig
from trl.assets import get_dataset_path, get_model_path
from trl.cli.accelerate_launcher import fill_launch_defaults
from trl.cli.main import main as trl_main
from trl.scripts._training import load_script_dataset
from trl.scripts.utils import ScriptArguments
from trl.trainer.online_rewards import reward_signature_problem


ACCELERATE_DEFAULTS_WARNING = "were not passed to `accelerate launch`"


def run_trl(*args, cwd=None):
    """`trl ARGS` in a child process that imports the `trl` under test (this checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(trl.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [sys.executable, "-c", "import sys; from trl.cli.main import main; sys.exit(main())", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def sft_command(output_dir, *extra):
    return [
        "sft",
        "--model_name_or_path",
        get_model_path("tiny-Qwen2ForCausalLM"),
        "--dataset_name",
        get_dataset_path("standard_language_modeling"),
        "--output_dir",
        str(output_dir),
        "--per_device_train_batch_size",
        "4",
        "--max_length",
        "32",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        *extra,
    ]


# ---------------------------------------------------------------------------------------------------------------------
# max_steps 0
# ---------------------------------------------------------------------------------------------------------------------
def test_max_steps_zero_warns_in_the_config(tmp_path):
    # transformers (and TRL 1.16) run one step at learning rate 0 and save the model as if trained: TRL completes the
    # run, so it is a warning here, not a refusal.
    with pytest.warns(UserWarning, match="max_steps=0 trains nothing"):
        assert SFTConfig(output_dir=str(tmp_path), max_steps=0).max_steps == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SFTConfig(output_dir=str(tmp_path), max_steps=-1).max_steps == -1


def test_max_steps_zero_on_the_command_line(tmp_path):
    result = run_trl(*sft_command(tmp_path / "out", "--max_steps", "0"))
    assert "max_steps=0 trains nothing" in result.stderr
    # The launch settings are stated in one line instead of accelerate's warning block.
    assert ACCELERATE_DEFAULTS_WARNING not in result.stderr
    assert "Launching 1 process" in result.stderr


# ---------------------------------------------------------------------------------------------------------------------
# A wrong --dataset_name path
# ---------------------------------------------------------------------------------------------------------------------
def test_missing_dataset_path_on_the_command_line(tmp_path):
    result = run_trl(*sft_command(tmp_path / "out", "--max_steps", "1"), "--dataset_name", "./data/no-such-set")
    assert result.returncode == 2
    assert "trl sft: error: The dataset path './data/no-such-set' does not exist" in result.stderr
    assert "Traceback" not in result.stderr and "Launching" not in result.stderr  # refused before launching


def test_missing_model_path_on_the_command_line(tmp_path):
    result = run_trl(*sft_command(tmp_path / "out"), "--model_name_or_path", str(tmp_path / "no-model"))
    assert result.returncode == 2 and "The model path" in result.stderr and "does not exist" in result.stderr


def test_missing_dataset_path_in_a_mixture(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text(f"datasets:\n  - path: {tmp_path / 'nowhere' / 'train.jsonl'}\n")
    result = run_trl(*sft_command(tmp_path / "out"), "--config", str(config))
    assert result.returncode == 2 and "The dataset path" in result.stderr


def test_missing_dataset_path_in_a_script():
    with pytest.raises(FileNotFoundError, match="The dataset path '/no/such/dir' does not exist"):
        load_script_dataset(ScriptArguments(dataset_name="/no/such/dir"), None)


# ---------------------------------------------------------------------------------------------------------------------
# accelerate's defaults warning
# ---------------------------------------------------------------------------------------------------------------------
def test_launch_defaults_are_filled_without_accelerates_warning(monkeypatch, caplog, tmp_path):
    import accelerate.commands.config as accelerate_config
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    monkeypatch.setattr(accelerate_config, "default_config_file", str(tmp_path / "absent.yaml"))
    import accelerate.commands.launch as accelerate_launch

    monkeypatch.setattr(accelerate_launch, "default_config_file", str(tmp_path / "absent.yaml"))
    args = launch_command_parser().parse_args(["script.py"])
    summary = fill_launch_defaults(args)
    assert summary is not None and summary.startswith("Launching ")
    assert (args.num_machines, args.mixed_precision, args.dynamo_backend) == (1, "no", "no")
    with caplog.at_level(logging.WARNING):
        _validate_launch_command(args)
    assert ACCELERATE_DEFAULTS_WARNING not in caplog.text

    # Values the user passed are kept, and a config file's are left to accelerate.
    args = launch_command_parser().parse_args(["--num_processes", "1", "--mixed_precision", "bf16", "script.py"])
    fill_launch_defaults(args)
    assert (args.num_processes, args.mixed_precision) == (1, "bf16")
    args = launch_command_parser().parse_args(["--config_file", "some.yaml", "script.py"])
    assert fill_launch_defaults(args) is None and args.num_processes is None


# ---------------------------------------------------------------------------------------------------------------------
# A reward function without **kwargs
# ---------------------------------------------------------------------------------------------------------------------
make_grpo_args = args_builder(GRPOConfig, **GROUP_ARGS)


def test_reward_function_without_kwargs_is_refused_at_construction(tmp_path, model_path, prompts):
    def brevity(completions):
        return [-len(completion) for completion in completions]

    with pytest.raises(TypeError, match=r"Reward function 'brevity'.*no `\*\*kwargs`.*'prompts'"):
        GRPOTrainer(model_path, reward_funcs=brevity, args=make_grpo_args(tmp_path), train_dataset=prompts)


def test_reward_signatures_that_work_are_accepted():
    keywords = ["prompts", "completions", "completion_ids", "trainer_state", "solution"]

    def with_kwargs(completions, **kwargs):
        return []

    def naming_every_keyword(prompts, completions, completion_ids, trainer_state, solution, scale=1.0):
        return []

    def needing_a_rollout_field(completions, tag, **kwargs):  # `tag` may come from a rollout_func
        return []

    class Scorer:
        def __call__(self, completions, **kwargs):
            return []

    for func in (with_kwargs, naming_every_keyword, Scorer(), needing_a_rollout_field):
        assert reward_signature_problem(func, keywords) is None, func
    assert "does not accept ['completion_ids'" in reward_signature_problem(lambda prompts, completions: [], keywords)


# ---------------------------------------------------------------------------------------------------------------------
# The closing line of a CLI run
# ---------------------------------------------------------------------------------------------------------------------
def test_cli_run_ends_with_where_things_went(tmp_path):
    output_dir = tmp_path / "out"
    result = run_trl(*sft_command(output_dir, "--max_steps", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert ACCELERATE_DEFAULTS_WARNING not in result.stderr
    closing = result.stdout.strip().splitlines()[-1]
    assert closing.startswith("Training finished at step 2; last logged loss ")
    assert f"model saved to {output_dir}" in closing and f"run report: {output_dir / 'report.html'}" in closing
    assert (output_dir / "metrics.jsonl").is_file() and (output_dir / "report.html").is_file()
    # The printed rows show numbers as numbers ({'loss': 7.843}, not transformers 5's {'loss': '7.843'}).
    printed = [line for line in result.stdout.splitlines() if line.startswith("{'loss': ")]
    assert printed and all(not line.startswith("{'loss': '") for line in printed), result.stdout[-2000:]
    # Logged metrics are numbers in the history file.
    assert trl_main(["report", str(output_dir)]) == 0


# ---------------------------------------------------------------------------------------------------------------------
# `accelerate launch --num_processes 2` on a machine without GPUs
# ---------------------------------------------------------------------------------------------------------------------
def test_accelerate_launch_that_starts_one_of_two_processes_warns(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(trl.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.update(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    script = os.path.join(root, "examples", "scripts", "sft.py")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", script]
    command += ["--output_dir", str(tmp_path), "--max_steps", "1", "--report_to", "none", "--save_strategy", "no"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "`accelerate launch --num_processes 2` started this run as 1 process" in result.stderr
    assert "accelerate launch --multi_gpu --use_cpu --num_processes 2" in result.stderr


def test_launch_check_reads_the_launching_command(monkeypatch):
    from trl.trainer.utils.console_logs import processes_asked_of_accelerate_launch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    launch = ["python", "accelerate", "launch"]
    assert processes_asked_of_accelerate_launch([*launch, "--num_processes", "2", "x.py"]) == 2
    assert processes_asked_of_accelerate_launch([*launch, "--num_processes=4", "x.py"]) == 4
    assert processes_asked_of_accelerate_launch([*launch, "x.py"]) is None
    assert processes_asked_of_accelerate_launch(["python", "x.py", "--num_processes", "2"]) is None
    monkeypatch.setenv("WORLD_SIZE", "2")  # a real multi-process launch
    assert processes_asked_of_accelerate_launch([*launch, "--num_processes", "2", "x.py"]) is None


def test_printed_rows_keep_numbers_as_numbers(tmp_path, capsys):
    from trl import SFTTrainer
    from trl.assets import load_test_dataset
    from trl.trainer.utils.console_logs import NumericPrinterCallback, printable_logs

    assert printable_logs({"loss": 7.84321, "total_flos": 1.0, "epoch": 1, "lr": float("nan")}) == {
        "loss": 7.843,
        "epoch": 1,
        "lr": pytest.approx(float("nan"), nan_ok=True),
    }
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, logging_steps=1, report_to="none", disable_tqdm=True)
    data = load_test_dataset("standard_language_modeling", "train")
    trainer = SFTTrainer(model=get_model_path("tiny-Qwen2ForCausalLM"), args=args, train_dataset=data)
    assert any(type(c) is NumericPrinterCallback for c in trainer.callback_handler.callbacks)
    trainer.train()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{'loss': ")]
    assert printed and printed[0][len("{'loss': ")].isdigit(), printed


def test_training_a_tiny_offline_model_says_so_once(monkeypatch, caplog):
    from types import SimpleNamespace

    from trl.trainer.utils import console_logs

    monkeypatch.setattr(console_logs, "_NOTED_TEST_MODELS", set())
    tiny = SimpleNamespace(config=SimpleNamespace(_name_or_path=get_model_path("tiny-Qwen2ForCausalLM")))
    with caplog.at_level(logging.WARNING, logger=console_logs.__name__):
        console_logs.note_offline_test_model(tiny)
        console_logs.note_offline_test_model(tiny)
        console_logs.note_offline_test_model(
            SimpleNamespace(config=SimpleNamespace(_name_or_path="/not/a/test/model"))
        )
    notes = [r.getMessage() for r in caplog.records if "tiny test model with random weights" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("Training tiny-Qwen2ForCausalLM")

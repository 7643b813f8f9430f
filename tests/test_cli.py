"""Tests for the `trl` command: sub-commands, help speed, argument routing, accelerate profiles and `trl env`."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from trl.cli._script_parser import build_script_parser, script_exists, script_path
from trl.cli.accelerate_config import available_profiles, resolve_accelerate_config_argument
from trl.cli.commands import Command, CommandContext, EnvCommand, TrainingCommand, VllmServeCommand, get_commands


TRAINING_COMMANDS = ["distillation", "dpo", "grpo", "kto", "reward", "rloo", "sft"]


def _trl_command() -> list[str]:
    executable = shutil.which("trl")
    return [executable] if executable else [sys.executable, "-m", "trl.cli.main"]


def _run_trl(*args: str, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*_trl_command(), *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=os.environ.copy()
    )


def _best_wall_time(*args: str, repeats: int = 3) -> tuple[float, subprocess.CompletedProcess]:
    # Best of a few runs: the machine is shared, and a single slow start says little about the command itself.
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = _run_trl(*args)
        best = min(best, time.perf_counter() - start)
        if best < 2.0:
            break
    return best, result


# --- the command table -----------------------------------------------------------------------------------------------


def test_get_commands_order_and_types():
    commands = get_commands()
    assert [c.name for c in commands] == [
        "distillation",
        "dpo",
        "env",
        "grpo",
        "kto",
        "report",
        "reward",
        "rloo",
        "sft",
        "vllm-serve",
    ]
    assert all(isinstance(c, Command) for c in commands)
    assert isinstance(commands[2], EnvCommand) and isinstance(commands[-1], VllmServeCommand)
    assert all(isinstance(c, TrainingCommand) for c in commands if c.name in TRAINING_COMMANDS)
    assert {c.name: c.help_text for c in commands}["sft"] == "Run the sft training script"
    assert commands[2].help_text == "Print the environment information"
    assert commands[-1].help_text == "Serve a model with vLLM"


def test_command_context_argv_after():
    context = CommandContext(argv=["sft", "--config", "a.yaml", "--lr", "1"])
    assert context.argv_after("sft") == ["--config", "a.yaml", "--lr", "1"]
    assert context.argv_after("missing") == context.argv


# --- help ------------------------------------------------------------------------------------------------------------


def test_trl_help_is_fast_and_lists_the_commands():
    elapsed, result = _best_wall_time("--help")
    assert result.returncode == 0, result.stderr
    for name in ["distillation", "dpo", "env", "grpo", "kto", "report", "reward", "rloo", "sft", "vllm-serve"]:
        assert re.search(rf"^\s+{re.escape(name)}\s", result.stdout, re.MULTILINE), name
    assert elapsed < 2.0, f"`trl --help` took {elapsed:.2f}s"


def test_trl_without_command_prints_help():
    result = _run_trl()
    assert result.returncode == 0
    assert result.stdout.startswith("usage: trl <command>")


def test_python_m_entry_point():
    result = subprocess.run([sys.executable, "-m", "trl.cli.main", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "vllm-serve" in result.stdout


def test_unknown_command():
    result = _run_trl("train")
    assert result.returncode == 2
    assert "invalid choice: 'train'" in result.stderr


def test_sft_help_is_fast_and_lists_the_options():
    elapsed, result = _best_wall_time("sft", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: trl sft [--config FILE] [options]")
    for option in [
        "--model_name_or_path",
        "--dataset_name",
        "--learning_rate",
        "--datasets",
        "--use_peft",
        "--lora_r",
    ]:
        assert option in result.stdout, option
    assert "(default: 2e-05)" in result.stdout  # SFTConfig's learning rate, not the TrainingArguments one
    assert "--accelerate_config" in result.stdout
    assert elapsed < 2.0, f"`trl sft --help` took {elapsed:.2f}s"


def test_main_lets_the_exit_of_help_and_usage_errors_propagate(capsys):
    """As in TRL: `trl.cli.main()` raises argparse's SystemExit (0 for --help, 2 for an unknown command)."""
    from trl.cli import main

    with pytest.raises(SystemExit) as exit_help:
        main(["--help"])
    assert exit_help.value.code == 0
    with pytest.raises(SystemExit) as exit_error:
        main(["no-such-command"])
    assert exit_error.value.code == 2
    assert "no-such-command" in capsys.readouterr().err


def test_sft_help_does_not_import_torch():
    code = (
        "import sys, contextlib, io\n"
        "from trl.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['sft', '--help'])\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate', 'datasets') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("name", [n for n in TRAINING_COMMANDS])
def test_light_parser_matches_the_script_parser(name):
    """The options read from source code (used for help and routing) are those the real script parser has."""
    import importlib

    real = importlib.import_module(f"trl.scripts.{name}").make_parser()
    light = build_script_parser(name, f"trl {name}")

    def describe(parser):
        return {
            option: (action.dest, action.nargs, action.const, action.required)
            for action in parser._actions
            for option in action.option_strings
            if action.dest != "help"
        }

    assert describe(light) == describe(real)


# --- every command has its script ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*TRAINING_COMMANDS, "vllm_serve"])
def test_every_command_has_its_script(name):
    assert script_exists(name), f"trl/scripts/{name}.py is missing"


# --- argument routing ------------------------------------------------------------------------------------------------


def test_unknown_flag_fails_with_a_suggestion():
    result = _run_trl("sft", "--output_dir", "out", "--lerning_rate", "1e-4")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "unrecognized argument '--lerning_rate' (did you mean '--learning_rate'?)" in lines[0]
    assert lines[0].startswith("trl sft: error:")


def test_unknown_yaml_key_fails_with_a_suggestion(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text("output_dir: out\nlerning_rate: 1.0e-4\n")
    result = _run_trl("sft", "--config", str(config))
    assert result.returncode == 2
    assert f"unknown key 'lerning_rate' in config file '{config}' (did you mean 'learning_rate'?)" in result.stderr


def test_invalid_choice_is_reported_before_launching():
    result = _run_trl("sft", "--loss_type", "mse")
    assert result.returncode == 2
    assert "argument --loss_type/--loss-type: invalid choice: 'mse'" in result.stderr


def test_split_arguments_yaml_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_CLI_TEST_VAR", "unset")  # restored after the test
    config = tmp_path / "sft.yaml"
    config.write_text(
        "model_name_or_path: some/model\n"
        "learning_rate: 1.0e-4\n"
        "num_processes: 4\n"
        "multi_gpu: true\n"
        "cpu: false\n"
        "accelerate_config: zero2\n"
        "env:\n"
        "  TRL_CLI_TEST_VAR: on\n"
    )
    argv = ["--config", str(config), "--learning_rate", "3e-4", "--num_processes", "2", "--max_steps", "5"]
    launch_args, script_args = TrainingCommand("sft").split_arguments(argv)
    zero2 = resolve_accelerate_config_argument(["--accelerate_config", "zero2"])[1]
    # YAML keys that are not script options go to accelerate first, the command line after (so it wins).
    assert launch_args == ["--config_file", zero2, "--num_processes", "4", "--multi_gpu", "--num_processes", "2"]
    assert script_args == ["--config", str(config), "--learning_rate", "3e-4", "--max_steps", "5"]
    assert os.environ["TRL_CLI_TEST_VAR"] == "True"  # YAML `on` is a boolean


def test_split_arguments_reports_every_unknown_argument():
    with pytest.raises(ValueError) as error:
        TrainingCommand("sft").split_arguments(["stray", "--lerning_rate", "3", "--num_proceses", "2"])
    message = str(error.value)
    assert "unrecognized argument '--lerning_rate' (did you mean '--learning_rate'?)" in message
    assert "unrecognized argument '--num_proceses' (did you mean '--num_processes'?)" in message
    assert "unexpected value 'stray'" in message


def test_config_leftovers_to_launch_args():
    from trl.cli.accelerate_launcher import config_leftovers_to_launch_args

    leftovers = {"num_processes": 2, "multi_gpu": True, "cpu": False, "gpu_ids": [0, 1], "main_process_port": None}
    assert config_leftovers_to_launch_args(leftovers) == ["--num_processes", "2", "--multi_gpu", "--gpu_ids", "0,1"]


# --- accelerate profiles and launching -------------------------------------------------------------------------------


_COMMON_PROFILE_KEYS = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "downcast_bf16": "no",
    "machine_rank": 0,
    "main_training_function": "main",
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 8,
    "rdzv_backend": "static",
    "same_network": True,
    "tpu_env": [],
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "use_cpu": False,
}


@pytest.mark.parametrize(
    ("profile", "distributed_type", "section", "expected"),
    [
        ("single_gpu", "NO", None, None),
        ("multi_gpu", "MULTI_GPU", None, None),
        ("zero1", "DEEPSPEED", "deepspeed_config", {"zero_stage": 1, "gradient_accumulation_steps": 1}),
        ("zero2", "DEEPSPEED", "deepspeed_config", {"zero_stage": 2, "offload_optimizer_device": "none"}),
        ("zero3", "DEEPSPEED", "deepspeed_config", {"zero_stage": 3, "zero3_init_flag": True}),
        ("fsdp1", "FSDP", "fsdp_config", {"fsdp_version": 1, "fsdp_reshard_after_forward": "FULL_SHARD"}),
        ("fsdp2", "FSDP", "fsdp_config", {"fsdp_version": 2, "fsdp_reshard_after_forward": True}),
    ],
)
def test_bundled_profiles(profile, distributed_type, section, expected):
    launch_args = resolve_accelerate_config_argument(["--num_processes", "2", "--accelerate_config", profile])
    assert launch_args[0] == "--config_file" and launch_args[2:] == ["--num_processes", "2"]
    assert os.path.basename(launch_args[1]) == f"{profile}.yaml"
    with open(launch_args[1]) as f:
        config = yaml.safe_load(f)
    assert config["distributed_type"] == distributed_type
    assert {key: config[key] for key in _COMMON_PROFILE_KEYS} == _COMMON_PROFILE_KEYS
    if section is not None:
        assert expected.items() <= config[section].items()
    else:
        assert config["gpu_ids"] == "all"


def test_multi_cpu_profile():
    assert set(available_profiles()) == {
        "fsdp1",
        "fsdp2",
        "multi_cpu",
        "multi_gpu",
        "single_gpu",
        "zero1",
        "zero2",
        "zero3",
    }
    path = resolve_accelerate_config_argument(["--accelerate_config=multi_cpu"])[1]
    with open(path) as f:
        config = yaml.safe_load(f)
    assert (config["distributed_type"], config["num_processes"], config["use_cpu"]) == ("MULTI_CPU", 2, True)
    assert config["mixed_precision"] == "no"


def test_accelerate_config_path_and_errors(tmp_path):
    custom = tmp_path / "my_accelerate.yaml"
    custom.write_text("distributed_type: 'NO'\n")
    assert resolve_accelerate_config_argument(["--accelerate_config", str(custom), "--cpu"]) == [
        "--config_file",
        str(custom),
        "--cpu",
    ]
    assert resolve_accelerate_config_argument(["--num_processes", "2"]) == ["--num_processes", "2"]
    with pytest.raises(ValueError, match="neither an existing file nor a bundled profile.*zero3"):
        resolve_accelerate_config_argument(["--accelerate_config", "zero4"])
    with pytest.raises(ValueError, match="no value was given"):
        resolve_accelerate_config_argument(["--accelerate_config"])


def _launch_namespace(*launch_args: str):
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser().parse_args([*launch_args, "script.py"])


def test_cpu_processes_are_routed_through_torchrun():
    from trl.cli.accelerate_launcher import route_cpu_processes

    args = _launch_namespace("--cpu", "--num_processes", "2")
    assert route_cpu_processes(args) == {"ACCELERATE_USE_CPU": "true"}
    assert (args.cpu, args.multi_gpu, args.num_processes, args.num_machines) == (False, True, 2, 1)
    assert (args.mixed_precision, args.dynamo_backend) == ("no", "no")

    profile = resolve_accelerate_config_argument(["--accelerate_config", "multi_cpu"])
    args = _launch_namespace(*profile)
    assert route_cpu_processes(args) == {"ACCELERATE_USE_CPU": "true"}
    assert (args.multi_gpu, args.num_processes) == (True, 2)

    args = _launch_namespace(*profile, "--num_processes", "3", "--mixed_precision", "bf16")
    route_cpu_processes(args)
    assert (args.num_processes, args.mixed_precision) == (3, "bf16")


@pytest.mark.parametrize(
    "launch_args",
    [
        ["--cpu"],
        ["--cpu", "--num_processes", "1"],
        ["--cpu", "--num_processes", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.1"],
        ["--use_deepspeed", "--num_processes", "2"],
    ],
)
def test_other_launches_are_left_alone(launch_args):
    from trl.cli.accelerate_launcher import route_cpu_processes

    args = _launch_namespace(*launch_args)
    before = vars(args).copy()
    assert route_cpu_processes(args) == {}
    assert vars(args) == before


@pytest.mark.parametrize("launch_args", [["--num_processes", "2"], ["--multi_gpu", "--num_processes", "2"]])
def test_multi_process_launch_without_cpu_flag(launch_args):
    """Without `--cpu`, processes stay on the accelerators when there are some, and go to the CPU otherwise."""
    from trl.cli.accelerate_launcher import has_accelerator, route_cpu_processes

    args = _launch_namespace(*launch_args)
    if has_accelerator():
        assert route_cpu_processes(args) == {}
        assert args.num_processes == 2
    else:
        assert route_cpu_processes(args) == {"ACCELERATE_USE_CPU": "true"}
        assert (args.multi_gpu, args.num_processes, args.cpu) == (True, 2, False)


def test_launch_training_script_builds_the_accelerate_namespace(monkeypatch):
    from trl.cli.accelerate_launcher import launch_training_script

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    seen = {}

    def record(args):
        seen["args"] = args
        seen["env"] = os.environ.get("ACCELERATE_USE_CPU")
        return "launched"

    result = launch_training_script(
        "sft", ["--cpu", "--num_processes", "2"], ["--config", "c.yaml", "--max_steps", "3"], launch_command_fn=record
    )
    assert result == "launched"
    args = seen["args"]
    assert args.training_script == script_path("sft")
    assert args.training_script_args == ["--config", "c.yaml", "--max_steps", "3"]
    assert (args.multi_gpu, args.num_processes) == (True, 2)
    assert seen["env"] == "true"
    assert "ACCELERATE_USE_CPU" not in os.environ  # only set while launching


# --- trl env ---------------------------------------------------------------------------------------------------------

_ENV_KEYS = [
    "Platform",
    "Python version",
    "TRL version",
    "PyTorch version",
    "accelerator(s)",
    "Transformers version",
    "Accelerate version",
    "Accelerate config",
    "Datasets version",
    "HF Hub version",
    "bitsandbytes version",
    "DeepSpeed version",
    "Liger-Kernel version",
    "PEFT version",
    "vLLM version",
]


def test_trl_env():
    import platform

    import accelerate
    import transformers

    result = _run_trl("env")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("\nCopy-paste the following information when reporting an issue:\n\n- Platform: ")
    entries = dict(re.findall(r"^- ([^:]+): (.*)$", result.stdout, re.MULTILINE))
    assert list(entries) == _ENV_KEYS
    assert entries["Python version"] == platform.python_version()
    assert entries["Transformers version"] == transformers.__version__
    assert entries["Accelerate version"] == accelerate.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*?(\+[0-9a-f]{7})?", entries["TRL version"])
    assert entries["accelerator(s)"]


# --- multi-process CPU launch ----------------------------------------------------------------------------------------

_PROBE = """
import json, os, sys
import torch
import torch.distributed as dist
from transformers import TrainingArguments

args = TrainingArguments(output_dir=sys.argv[1], report_to="none")
value = torch.tensor([float(args.process_index + 1)])
dist.all_reduce(value)
with open(os.path.join(sys.argv[1], f"rank{args.process_index}.json"), "w") as f:
    json.dump({"world": args.world_size, "backend": dist.get_backend(), "sum": value.item(),
               "device": str(args.device), "args": sys.argv[2:]}, f)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.distributed
@pytest.mark.parametrize(
    "launch_args",
    [["--cpu", "--num_processes", "2"], ["--accelerate_config", "multi_cpu"], ["--num_processes", "2"]],
)
def test_two_cpu_processes_really_start(tmp_path, launch_args):
    from trl.cli.accelerate_launcher import has_accelerator

    if "--cpu" not in launch_args and "--accelerate_config" not in launch_args and has_accelerator():
        pytest.skip("with accelerators, a plain --num_processes launch uses them")
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    code = (
        "import sys\n"
        "from trl.cli.accelerate_config import resolve_accelerate_config_argument\n"
        "from trl.cli.accelerate_launcher import launch_training_script\n"
        f"launch_training_script({str(probe)!r}, resolve_accelerate_config_argument({launch_args!r}), "
        f"[{str(tmp_path)!r}, '--flag', 'x'])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        assert report.pop("device").startswith("cpu")
        assert report == {"world": 2, "backend": "gloo", "sum": 3.0, "args": ["--flag", "x"]}


# --- a real run ------------------------------------------------------------------------------------------------------


def test_sft_run_with_yaml_mixture_and_flag_override(tmp_path):
    from trl.assets import get_model_path

    for name, count in (("a", 6), ("b", 10)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(count):
                f.write(json.dumps({"text": f"The {name} sentence number {i}.", "extra": i}) + "\n")
    config = tmp_path / "sft.yaml"
    config.write_text(
        f"model_name_or_path: {get_model_path('tiny-Qwen2ForCausalLM')}\n"
        "datasets:\n"
        f"  - path: {tmp_path / 'a.jsonl'}\n"
        "    columns: [text]\n"
        f"  - path: {tmp_path / 'b.jsonl'}\n"
        "    columns: [text]\n"
        "learning_rate: 1.0e-3\n"
        "per_device_train_batch_size: 4\n"
        "num_train_epochs: 1\n"
        "max_length: 32\n"
        "report_to: none\n"
        "num_processes: 1\n"  # not a script option: forwarded to accelerate launch
    )
    output_dir = tmp_path / "out"
    result = _run_trl("sft", "--config", str(config), "--learning_rate", "5e-4", "--output_dir", str(output_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (output_dir / "model.safetensors").is_file()
    (state_file,) = output_dir.glob("checkpoint-*/trainer_state.json")
    state = json.loads(state_file.read_text())
    assert state["global_step"] == 4  # 6 + 10 mixed rows, 4 per step, one epoch
    assert state["train_batch_size"] == 4  # from the YAML file
    import torch

    training_args = torch.load(output_dir / "training_args.bin", weights_only=False)
    assert training_args.learning_rate == 5e-4  # the flag wins over the YAML value
    assert training_args.per_device_train_batch_size == 4


# --- example configs -------------------------------------------------------------------------------------------------

_EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "cli_configs")
_EXAMPLES = ["distillation", "dpo", "grpo", "kto", "reward", "rloo", "sft"]


def test_every_training_command_has_an_example_config():
    assert sorted(f[: -len(".yaml")] for f in os.listdir(_EXAMPLES_DIR) if f.endswith(".yaml")) == _EXAMPLES


@pytest.mark.parametrize("name", [n for n in _EXAMPLES])
def test_example_config_keys_are_script_options(name, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    config = os.path.join(_EXAMPLES_DIR, f"{name}.yaml")
    launch_args, script_args = TrainingCommand(name).split_arguments(["--config", config])
    assert launch_args == []
    assert script_args == ["--config", config]


def _link_assets(workdir, config_path) -> None:
    """Build the assets an example refers to and expose them as `<workdir>/.trl-assets/v1/...`."""
    from trl.assets import get_dataset_path, get_model_path

    with open(config_path) as f:
        values = [v for v in yaml.safe_load(f).values() if isinstance(v, str) and v.startswith(".trl-assets/")]
    root = None
    for value in values:
        _, version, kind, name = value.split("/")
        built = get_model_path(name) if kind == "models" else get_dataset_path(name)
        root = os.path.dirname(os.path.dirname(built))
        assert os.path.basename(root) == version, "the examples point to another assets version"
    (workdir / ".trl-assets").mkdir()
    os.symlink(root, workdir / ".trl-assets" / os.path.basename(root))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in _EXAMPLES])
def test_example_config_runs(name, tmp_path):
    config = os.path.join(_EXAMPLES_DIR, f"{name}.yaml")
    _link_assets(tmp_path, config)
    result = _run_trl(name, "--config", config, "--max_steps", "1", "--output_dir", "out", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "config.json").is_file()

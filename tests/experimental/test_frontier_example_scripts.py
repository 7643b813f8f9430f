"""The example scripts of the frontier trainers that need a server or an external service (see
`tests/test_examples.py` for the scripts that train offline as they are):

- `examples/scripts/async_grpo.py`: without a vLLM server it stops before training with a `ConnectionError`; with an
  in-process generation backend in the server's place it trains a step on its GSM8K-style questions and saves.
- `examples/scripts/harbor/data_agent.py` with each harness in `examples/scripts/harbor/harnesses/`: GRPO trains on
  Harbor tasks whose sandboxes are local directories (a fake `harbor`: commands run in bash, the verifier compares
  `/workdir/answer.txt` with the task's gold answer).
- `examples/scripts/openreward/seta.py`: GRPO trains against the fake `openreward` SDK of
  `test_harbor_openreward.py`.

The real Harbor sandboxes, the OpenReward service and a vLLM server are not exercised here. The tool-calling runs
script the tiny model's replies with `ScriptedReplies` (the tool loop, environments and rewards are the real ones).
"""

import asyncio
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_async_grpo import LocalBackend, LocalTransfer
from test_harbor_openreward import ExecResult, FakeClient, fake_harbor, fake_openreward, write_tasks  # noqa: F401
from trainer_utils import requires_response_parser, train_logs


pytestmark = pytest.mark.usefixtures("single_thread")

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples" / "scripts"


def load_script(relative_path: str) -> dict:
    """The script's module namespace, without running its `__main__` block."""
    return runpy.run_path(str(EXAMPLES_DIR / relative_path), run_name="example_under_test")


# ---------------------------------------------------------------------------------------------------------------------
# AsyncGRPO
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_async_grpo_example_without_server_fails_before_training(tmp_path, monkeypatch):
    path = str(EXAMPLES_DIR / "async_grpo.py")
    argv = [path, "--output_dir", str(tmp_path), "--max_steps", "1", "--report_to", "none", "--use_cpu", "true"]
    argv += ["--vllm_server_base_url", "http://127.0.0.1:9", "--vllm_server_timeout", "0.5"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    with pytest.raises(ConnectionError, match="vLLM server can't be reached"):
        runpy.run_path(path, run_name="__main__")
    assert not os.path.exists(tmp_path / "checkpoint-1")


def test_async_grpo_example_builds_gsm8k_prompts():
    script = load_script("async_grpo.py")
    row = script["to_math_prompt"]({"question": "How many?", "answer": "3 + 4 = 7\n#### 1,007"})
    assert row["solution"] == "1007"
    assert row["prompt"][-1] == {"role": "user", "content": "How many?"} and row["prompt"][0]["role"] == "system"
    offline = script["offline_gsm8k"]()
    assert offline.column_names == ["question", "answer"] and offline[0]["answer"] == "#### 5"


@pytest.mark.timeout(300)
def test_async_grpo_example_trains_with_an_in_process_backend(tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    script = load_script("async_grpo.py")
    args = ["--output_dir", str(tmp_path), "--max_steps", "1", "--per_device_train_batch_size", "4"]
    args += ["--num_generations", "4", "--max_completion_length", "8", "--token_budget", "256", "--use_cpu", "true"]
    args += ["--report_to", "none", "--save_strategy", "no", "--heartbeat_stale_after_s", "60"]
    script_args, training_args, model_args = script["parse_args"](args)
    backend = LocalBackend(model_args.model_name_or_path)

    class InProcessAsyncGRPOTrainer(AsyncGRPOTrainer):
        """Generates with `LocalBackend` and pushes weights into it, where the example talks to a vLLM server."""

        _poll_interval_s = 0.2

        def _build_generation_backend(self):
            return backend

        def _build_weight_transfer(self, policy, args):
            return LocalTransfer(backend)

    trainer = script["main"](script_args, training_args, model_args, trainer_class=InProcessAsyncGRPOTrainer)
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path))
    assert trainer.state.global_step == 1 and trainer.model_version == 2  # initial sync + one per step
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"reward", "rewards/accuracy_reward", "loss"} <= logged


# ---------------------------------------------------------------------------------------------------------------------
# Harbor data agent: sandboxes that are local directories
# ---------------------------------------------------------------------------------------------------------------------
class LocalSandbox:
    """A Harbor sandbox that is a temporary directory: commands run in bash with `/workdir` and `/home/user` mapped
    into it, so the harnesses' real shell commands (base64, python3, notes files) run as they would in a container."""

    started: list = []

    def __init__(self, type, environment_dir, environment_name, session_id, trial_paths, task_env_config):
        self.root = Path(tempfile.mkdtemp(prefix="trl-test-sandbox-"))
        self.alive = False
        LocalSandbox.started.append(self)

    def local(self, text: str) -> str:
        return text.replace("/workdir", f"{self.root}/workdir").replace("/home/user", f"{self.root}/home/user")

    async def start(self, force_build):
        self.alive = True

    async def stop(self, delete):
        self.alive = False
        shutil.rmtree(self.root, ignore_errors=True)

    async def upload_file(self, source, target):
        Path(self.local(target)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, self.local(target))

    async def upload_dir(self, source, target):
        shutil.copytree(source, self.local(target), dirs_exist_ok=True)

    async def run_healthcheck(self):
        pass

    async def exec(self, command, timeout_sec=None):
        process = await asyncio.create_subprocess_exec(
            "bash", "-c", self.local(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_sec)
        return ExecResult(stdout.decode(), stderr.decode(), process.returncode)


class LocalVerifier:
    """Reward 1.0 when the sandbox's `/workdir/answer.txt` holds the task's gold answer."""

    def __init__(self, task, trial_paths, environment):
        self.task, self.environment = task, environment

    async def verify(self):
        answer = Path(self.environment.local("/workdir/answer.txt"))
        correct = answer.is_file() and answer.read_text().strip() == self.task.gold
        return type("Result", (), {"rewards": {"reward": 1.0 if correct else 0.0}})()


@pytest.fixture
def local_harbor(fake_harbor, monkeypatch):  # noqa: F811 - the fixture imported above
    monkeypatch.setattr(
        sys.modules["harbor.environments.factory"].EnvironmentFactory, "create_environment", LocalSandbox
    )
    monkeypatch.setitem(sys.modules, "harbor.verifier.verifier", type(sys)("harbor.verifier.verifier"))
    sys.modules["harbor.verifier.verifier"].Verifier = LocalVerifier
    LocalSandbox.started = []


# Each harness's scripted episode: every task gets the answer 0, right for task 0 (gold 0), wrong for task 1 (gold 7).
HARNESS_EPISODES = {
    "bash": [("bash", {"command": "ls /home/user/input && echo 0 > /workdir/answer.txt"})],
    "jupyter": [
        ("python", {"code": "rows = open('../home/user/input/data.csv').read()"}),
        ("python", {"code": "open('answer.txt', 'w').write(str(len(rows) - len(rows)))"}),
    ],
    "terminal_notes": [
        ("write_note", {"note": "the answer is 0"}),
        ("bash", {"command": "echo 0 > /workdir/answer.txt"}),
    ],
}


def scripted_episode(calls):
    from test_grpo_tools import tool_call

    def reply(text, turn):
        return tool_call(calls[turn][0], **calls[turn][1]) if turn < len(calls) else "Done."

    return reply


@requires_response_parser
@pytest.mark.timeout(300)
@pytest.mark.parametrize("harness", sorted(HARNESS_EPISODES))
def test_data_agent_example_trains_with_each_harness(tmp_path, local_harbor, harness):
    from test_grpo_tools import ScriptedReplies

    script = load_script("harbor/data_agent.py")
    tasks = write_tasks(tmp_path / "tasks", count=2)
    args = script["parse_args"](
        ["--tasks", str(tasks), "--harness", harness, "--output_dir", str(tmp_path / "out"), "--max_steps", "1"]
        + ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "256"]
    )
    trainer = script["build_trainer"](args)
    ScriptedReplies(trainer, scripted_episode(HARNESS_EPISODES[harness]))
    trainer.train()
    assert type(trainer.environments[0]).__name__ == script["HARNESSES"][harness]
    log = train_logs(trainer)[-1]
    assert log["rewards/harbor_reward/mean"] == 0.5
    assert log["tools/failure_frequency"] == 0.0 and log["tools/call_frequency"] == len(HARNESS_EPISODES[harness])
    assert len(LocalSandbox.started) >= 4 and not any(sandbox.alive for sandbox in LocalSandbox.started[:-4])


def test_data_agent_harness_tools_in_a_local_sandbox(tmp_path, local_harbor):
    """The notebook keeps variables between cells and drops failed ones; the notes persist; outputs as documented."""
    script = load_script("harbor/data_agent.py")
    spec_dir = str(write_tasks(tmp_path / "tasks", count=1) / "tasks" / "task-00")
    jupyter = script["HarborSpec"](str(tmp_path / "tasks"), agent=script["harness_reference"]("jupyter")).agent()
    assert jupyter.reset(task_dir=spec_dir).endswith("/workdir/answer.txt.")
    assert jupyter.python("x = 20\nprint('set')") == "set\n"
    assert "ZeroDivisionError" in jupyter.python("1 / 0")
    assert jupyter.python("x + 1") == "21\n"
    # Cells run in /workdir (the local sandbox maps only the shell's paths, not those inside the code).
    assert jupyter.python("open('../home/user/input/data.csv').read()") == "'a,b\\n'\n"
    notes = script["HarborSpec"](str(tmp_path / "tasks"), agent=script["harness_reference"]("terminal_notes")).agent()
    notes.reset(task_dir=spec_dir)
    assert notes.read_notes() == "(no notes yet)"
    assert notes.write_note("column 'a' has \"quotes\" and $HOME") == "Noted."
    notes.write_note("second")
    assert notes.read_notes() == "- column 'a' has \"quotes\" and $HOME\n- second\n"
    assert notes.bash("cat /home/user/input/data.csv") == "a,b\n"


# ---------------------------------------------------------------------------------------------------------------------
# OpenReward SETA: the fake SDK of test_harbor_openreward (task i asks for the number 3·i; `submit` grades it)
# ---------------------------------------------------------------------------------------------------------------------
@requires_response_parser
@pytest.mark.timeout(300)
def test_seta_example_trains_against_a_fake_openreward(tmp_path, fake_openreward, monkeypatch):  # noqa: F811
    from test_grpo_tools import ScriptedReplies

    monkeypatch.setenv("OPENREWARD_API_KEY", "test-key")
    script = load_script("openreward/seta.py")
    seta_args, training_args, model_args = script["parse_args"](
        ["--output_dir", str(tmp_path), "--num_tasks", "2", "--max_steps", "1", "--per_device_train_batch_size", "4"]
        + ["--num_generations", "2", "--max_completion_length", "128", "--report_to", "none"]
        + ["--gradient_checkpointing", "false", "--max_tool_calling_iterations", "2", "--logging_steps", "1"]
    )
    trainer = script["build_trainer"](seta_args, training_args, model_args)
    assert FakeClient.instances[-1].name == "Eigent/SETA" and FakeClient.instances[-1].api_key == "test-key"
    ScriptedReplies(trainer, scripted_episode([("submit", {"answer": 0})]))  # right for task 0 only
    trainer.train()
    log = train_logs(trainer)[-1]
    assert log["rewards/openreward_reward/mean"] == 0.5 and log["tools/call_frequency"] == 1.0

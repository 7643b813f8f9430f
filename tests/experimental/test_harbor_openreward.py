"""Harbor and OpenReward adapters, tested against local fakes of the `harbor` and `openreward` packages.

The real packages cannot run here (Harbor starts containers, OpenReward talks to a server), so each test installs a
fake module with the same import paths and the few calls the adapters make (Harbor: `Task`, `TrialPaths`,
`EnvironmentFactory.create_environment`, the environment's `start` / `exec` / `upload_*` / `run_healthcheck` /
`stop`, `Verifier.verify`; OpenReward: `OpenReward(...).environments.get`, `num_tasks`, `get_task`, `list_tools`,
`session(...)` with `get_prompt`, `list_tools`, `call_tool`). What is checked is the adapters' own behaviour: task
selection, dataset columns, tool methods, prompts, rewards, errors, and one GRPO run through `environment_factory`.
"""

import pickle
import sys
import types
from dataclasses import dataclass, field

import pytest
from trainer_utils import requires_response_parser

from trl.experimental.harbor import AGENTS, HarborBashEnv, HarborEnv, HarborSpec
from trl.experimental.harbor import environment as harbor_environment
from trl.experimental.harbor.spec import harbor_reward
from trl.experimental.openreward import OpenRewardSpec
from trl.experimental.openreward import spec as openreward_spec
from trl.experimental.openreward.environment import make_tool_method


# ---------------------------------------------------------------------------------------------------------------------
# A fake `harbor`: a sandbox is a dict of files; `exec` understands `echo TEXT > PATH`, `cat PATH` and `mkdir`
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class ExecResult:
    stdout: str = ""
    stderr: str = ""
    return_code: int = 0


class FakeSandbox:
    started: list = []

    def __init__(self, type, environment_dir, environment_name, session_id, trial_paths, task_env_config):
        self.type, self.name, self.files, self.uploads, self.commands = type, environment_name, {}, [], []
        self.alive = False
        self.healthchecked = False
        FakeSandbox.started.append(self)

    async def start(self, force_build):
        self.alive = True

    async def stop(self, delete):
        self.alive = False

    async def upload_file(self, source, target):
        self.uploads.append((source.name, target))

    async def upload_dir(self, source, target):
        self.uploads.append((source.name + "/", target))

    async def run_healthcheck(self):
        self.healthchecked = True

    async def exec(self, command, timeout_sec=None):
        self.commands.append(command)
        if command.startswith("echo ") and ">" in command:
            text, path = command[5:].split(">", 1)
            self.files[path.strip()] = text.strip()
            return ExecResult()
        if command.startswith("cat "):
            path = command[4:].strip()
            if path in self.files:
                return ExecResult(stdout=self.files[path])
            return ExecResult(stderr=f"cat: {path}: No such file", return_code=1)
        return ExecResult()


class FakeTask:
    def __init__(self, task_dir):
        self.name = task_dir.name
        self.instruction = (task_dir / "instruction.md").read_text()
        self.paths = types.SimpleNamespace(environment_dir=task_dir / "environment")
        healthcheck = "true" if (task_dir / "healthcheck").exists() else None
        self.config = types.SimpleNamespace(environment=types.SimpleNamespace(healthcheck=healthcheck))
        self.gold = (task_dir / "gold.txt").read_text().strip()


class FakeVerifier:
    def __init__(self, task, trial_paths, environment):
        self.task, self.environment = task, environment

    async def verify(self):
        correct = self.environment.files.get("/workdir/answer.txt") == self.task.gold
        return types.SimpleNamespace(rewards={"reward": 1.0 if correct else 0.0})


@pytest.fixture
def fake_harbor(monkeypatch):
    modules = {
        "harbor": types.ModuleType("harbor"),
        "harbor.environments": types.ModuleType("harbor.environments"),
        "harbor.environments.factory": types.SimpleNamespace(
            EnvironmentFactory=types.SimpleNamespace(create_environment=FakeSandbox)
        ),
        "harbor.models": types.ModuleType("harbor.models"),
        "harbor.models.environment_type": types.SimpleNamespace(EnvironmentType=str),
        "harbor.models.task": types.ModuleType("harbor.models.task"),
        "harbor.models.task.task": types.SimpleNamespace(Task=FakeTask),
        "harbor.models.trial": types.ModuleType("harbor.models.trial"),
        "harbor.models.trial.paths": types.SimpleNamespace(TrialPaths=lambda path: path),
        "harbor.verifier": types.ModuleType("harbor.verifier"),
        "harbor.verifier.verifier": types.SimpleNamespace(Verifier=FakeVerifier),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(harbor_environment, "is_harbor_available", lambda: True)
    FakeSandbox.started = []


def write_tasks(root, count=3, nested=True):
    base = root / "tasks" if nested else root
    for i in range(count):
        task = base / f"task-{i:02d}"
        (task / "environment").mkdir(parents=True)
        (task / "environment" / "data.csv").write_text("a,b\n")
        (task / "environment" / "Dockerfile").write_text("FROM python:3.12\nCOPY data.csv /home/user/input/\n")
        (task / "instruction.md").write_text(f"Task {i}: write the answer.")
        (task / "gold.txt").write_text(str(i * 7))
        (task / "task.toml").write_text(
            f'[metadata]\ngold_answer = "{i * 7}"\nreward_mode_initial = "exact"\ndifficulty_level = "easy"\n'
        )
    (base / "not-a-task").mkdir(parents=True)
    return root


# ---------------------------------------------------------------------------------------------------------------------
# HarborSpec
# ---------------------------------------------------------------------------------------------------------------------
def test_harbor_spec_dataset_and_selection(tmp_path):
    spec = HarborSpec(str(write_tasks(tmp_path)), num_tasks=2)
    data = spec.train_dataset
    assert data.column_names == [
        "prompt",
        "task_dir",
        "task_index",
        "gold_answer",
        "reward_mode",
        "difficulty_level",
        "kaggle_dataset",
    ]
    assert data["task_index"] == [0, 1] and data["gold_answer"] == ["0", "7"]
    assert data[0]["prompt"] == [{"role": "user", "content": ""}] and data["kaggle_dataset"] == [None, None]
    picked = HarborSpec(str(tmp_path), indices=[2, 0], include_metadata=False).train_dataset
    assert picked.column_names == ["prompt", "task_dir", "task_index"]
    assert picked["task_index"] == [2, 0] and picked["task_dir"][0].endswith("task-02")
    flat = HarborSpec(str(write_tasks(tmp_path / "flat", count=1, nested=False))).train_dataset
    assert len(flat) == 1


def test_harbor_spec_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="num_tasks or indices"):
        HarborSpec(str(tmp_path), num_tasks=1, indices=[0])
    with pytest.raises(ValueError, match="No Harbor task"):
        HarborSpec(str(tmp_path)).task_dirs()
    with pytest.raises(ValueError, match="neither a built-in agent"):
        HarborSpec(str(tmp_path), agent="jupyter")
    with pytest.raises(TypeError, match="subclass of HarborEnv"):
        HarborSpec(str(tmp_path), agent=dict)


def test_harbor_agent_references(tmp_path):
    assert HarborSpec(str(tmp_path)).agent is AGENTS["bash"] is HarborBashEnv
    harness = tmp_path / "harness.py"
    harness.write_text(
        "from trl.experimental.harbor import HarborEnv\n\n"
        "class NotesEnv(HarborEnv):\n"
        "    def note(self, text: str) -> str:\n"
        '        """Keep a note.\n\n        Args:\n            text: The note.\n        """\n'
        "        return text\n"
    )
    assert HarborSpec(str(tmp_path), agent=f"{harness}:NotesEnv").agent.__name__ == "NotesEnv"
    assert HarborSpec(str(tmp_path), agent="trl.experimental.harbor:HarborBashEnv").agent is HarborBashEnv
    with pytest.raises(ValueError, match="defines no"):
        HarborSpec(str(tmp_path), agent=f"{harness}:Missing")


def test_harbor_environment_lifecycle(tmp_path, fake_harbor):
    spec = HarborSpec(str(write_tasks(tmp_path)), environment_type="daytona")
    factory = spec.environment_factory
    assert pickle.loads(pickle.dumps(factory)).keywords == {"environment_type": "daytona"}
    env = factory()
    assert env.reward == 0.0  # never reset
    with pytest.raises(ValueError, match="task_dir"):
        env.reset()
    row = spec.train_dataset[1]
    prompt = env.reset(task_dir=row["task_dir"])
    assert prompt == "Task 1: write the answer." + HarborBashEnv.PROMPT_SUFFIX
    sandbox = FakeSandbox.started[-1]
    assert sandbox.alive and sandbox.uploads == [("data.csv", "/home/user/input/data.csv")]
    assert "mkdir -p /workdir /home/user/input" in sandbox.commands
    assert env.bash("cat /workdir/answer.txt").startswith("cat: /workdir/answer.txt")
    assert env.bash("echo 7 > /workdir/answer.txt") == "(no output; return code 0)"
    assert env.bash("cat /workdir/answer.txt") == "7"
    assert env.reward == 1.0
    assert harbor_reward(environments=[env]) == [1.0]
    assert harbor_reward(environments=[env], environment_reward=[0.5]) == [0.5]
    env.reset(task_dir=spec.train_dataset[0]["task_dir"])  # a new sandbox; the old one is stopped
    assert not sandbox.alive and env.reward == 0.0


def test_harbor_env_without_harbor_installed_raises_import_error(tmp_path, monkeypatch):
    monkeypatch.setattr(harbor_environment, "is_harbor_available", lambda: False)
    with pytest.raises(ImportError, match="trl\\[harbor\\]"):
        HarborEnv().reset(task_dir=str(tmp_path))


# ---------------------------------------------------------------------------------------------------------------------
# A fake `openreward`: tasks ask for a number; the `submit` tool rewards the right one and finishes
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Block:
    text: str


@dataclass
class ToolSpec:
    name: str
    description: str
    input_schema: dict


@dataclass
class ToolOutput:
    blocks: list
    metadata: dict = field(default_factory=dict)
    reward: float | None = None
    finished: bool = False


SUBMIT = ToolSpec(
    "submit",
    "Submit the final answer.",
    {
        "type": "object",
        "properties": {
            "note": {"type": "string", "description": "Optional remark."},
            "answer": {"type": "integer", "description": "The number."},
        },
        "required": ["answer"],
    },
)
PEEK = ToolSpec("peek", "Look at the task.", {"type": "object", "properties": {}})


class FakeSession:
    def __init__(self, env, index):
        self.env, self.index, self.open = env, index, False

    def __enter__(self):
        self.open = True
        self.env.sessions.append(self)
        return self

    def __exit__(self, *exc):
        self.open = False

    def get_prompt(self):
        return [Block(f"Give the number {self.index * 3}."), Block("Use submit.")]

    def list_tools(self):
        return [SUBMIT, PEEK] if self.index == 0 else [SUBMIT]

    def call_tool(self, name, arguments):
        if name == "peek":
            return ToolOutput([Block("nothing to see")])
        if arguments.get("answer") is None:
            raise RuntimeError("answer is required")
        correct = arguments["answer"] == self.index * 3
        return ToolOutput([Block("right" if correct else "wrong")], {"tries": 1}, float(correct), True)


class FakeEnvironment:
    def __init__(self):
        self.sessions = []

    def num_tasks(self, split):
        return 5

    def get_task(self, split, index):
        return types.SimpleNamespace(task_spec={"level": index % 2, "prompt": "hidden", "id": f"t{index}"})

    def list_tools(self):
        return [PEEK]

    def session(self, task=None, secrets=None, *, split=None, index=None):
        self.last_secrets = secrets
        return FakeSession(self, index)


class FakeClient:
    instances = []

    def __init__(self, api_key=None, base_url=None):
        self.api_key, self.base_url = api_key, base_url
        self.environment = FakeEnvironment()
        self.environments = types.SimpleNamespace(get=self.get)
        FakeClient.instances.append(self)

    def get(self, name):
        self.name = name
        return self.environment


@pytest.fixture
def fake_openreward(monkeypatch):
    monkeypatch.setitem(sys.modules, "openreward", types.SimpleNamespace(OpenReward=FakeClient))
    monkeypatch.setattr(openreward_spec, "is_openreward_available", lambda: True)
    FakeClient.instances = []


def test_openreward_spec_dataset_and_client(fake_openreward, monkeypatch):
    monkeypatch.setenv("OPENREWARD_API_KEY", "key-from-env")
    spec = OpenRewardSpec("Org/Env", num_tasks=3)
    data = spec.train_dataset
    assert data.column_names == ["prompt", "task_index", "id", "level"]
    assert data["task_index"] == [0, 1, 2] and data["id"] == ["t0", "t1", "t2"]
    client = FakeClient.instances[-1]
    assert (client.api_key, client.base_url, client.name) == ("key-from-env", None, "Org/Env")
    assert spec.secrets == {"api_key": "key-from-env"}
    server = OpenRewardSpec("http://localhost:8080", indices=[4, 1], include_metadata=False, env_name="math")
    assert server.train_dataset.column_names == ["prompt", "task_index"]
    assert server.train_dataset["task_index"] == [4, 1]
    assert server.environment is FakeClient.instances[-1].environment  # made on first use
    client = FakeClient.instances[-1]
    assert (client.base_url, client.name) == ("http://localhost:8080", "math") and server.secrets == {}
    assert len(OpenRewardSpec("Org/Env").train_dataset) == 5
    with pytest.raises(ValueError, match="num_tasks or indices"):
        OpenRewardSpec("Org/Env", num_tasks=1, indices=[0])


def test_openreward_environment_tools_prompt_and_reward(fake_openreward):
    spec = OpenRewardSpec("Org/Env", api_key="k", num_tasks=2)
    factory = spec.environment_factory
    assert {"submit", "peek"} <= set(vars(factory))  # discovered on task 0's session
    env = factory()
    assert env.reward is None
    assert env.submit(answer=3).startswith("Error: the environment has no open session")
    assert env.reset(task_index=1) == "Give the number 3.\nUse submit."
    assert env.peek() == "nothing to see" and env.reward is None
    assert env.submit(answer=4) == "wrong" and env.reward == 0.0
    assert env.submit(answer=3, note="sure") == "right"
    assert env.reward == 1.0 and env.finished and env.metadata == {"tries": 1}
    assert env.submit(note="no answer").startswith("Error: RuntimeError: answer is required")
    assert openreward_spec.openreward_reward(environments=[env, factory()]) == [1.0, None]
    first = spec.environment.sessions[-1]
    env.reset(task_index=0)
    assert not first.open and spec.environment.last_secrets == {"api_key": "k"}


def test_openreward_tool_discovery_options(fake_openreward):
    by_index = OpenRewardSpec("Org/Env", indices=[1, 2], api_key="k").environment_factory
    assert "submit" in vars(by_index) and "peek" not in vars(by_index)
    shared = OpenRewardSpec("Org/Env", api_key="k", discover_task_tools=False).environment_factory
    assert "peek" in vars(shared) and "submit" not in vars(shared)


def test_generated_tool_method_signature_and_docstring():
    import inspect

    from transformers.utils import get_json_schema

    method = make_tool_method(SUBMIT.name, SUBMIT.description, SUBMIT.input_schema)
    assert list(inspect.signature(method).parameters) == ["self", "answer", "note"]
    schema = get_json_schema(type("Holder", (), {"submit": method})().submit)
    assert schema["function"]["name"] == "submit"
    assert schema["function"]["parameters"]["required"] == ["answer"]
    assert schema["function"]["parameters"]["properties"]["answer"]["type"] == "integer"
    with pytest.raises(ValueError, match="not a Python identifier"):
        make_tool_method("run-code", "", None)


def test_openreward_without_package_raises_import_error(monkeypatch):
    monkeypatch.setattr(openreward_spec, "is_openreward_available", lambda: False)
    with pytest.raises(ImportError, match="trl\\[openreward\\]"):
        _ = OpenRewardSpec("Org/Env").train_dataset


# ---------------------------------------------------------------------------------------------------------------------
# End to end: GRPO drives the Harbor environments (fake sandbox) through environment_factory
# ---------------------------------------------------------------------------------------------------------------------
@requires_response_parser
def test_grpo_trains_on_harbor_tasks(tmp_path, model_path, fake_harbor):
    from test_grpo_tools import ScriptedReplies, make_args, tool_call, train_log

    from trl import GRPOTrainer

    spec = HarborSpec(str(write_tasks(tmp_path / "tasks")), num_tasks=2)
    trainer = GRPOTrainer(
        model_path,
        reward_funcs=spec.reward_funcs,
        args=make_args(tmp_path / "out"),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
    )

    def reply(text, turn):  # task 0's answer is 0 (right), task 1's is 7 (the model writes 0: wrong)
        return tool_call("bash", command="echo 0 > /workdir/answer.txt") if turn == 0 else "done"

    ScriptedReplies(trainer, reply)
    trainer.train()
    log = train_log(trainer)
    assert log["rewards/harbor_reward/mean"] == 0.5
    assert log["tools/call_frequency"] > 0
    assert len(FakeSandbox.started) >= 4  # one sandbox per rollout row

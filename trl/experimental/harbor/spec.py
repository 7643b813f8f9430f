"""`HarborSpec`: a Harbor task set as the three things GRPO needs (`train_dataset`, `environment_factory`,
`reward_funcs`)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from .environment import AGENTS, HarborEnv


_METADATA_COLUMNS = {
    "gold_answer": "gold_answer",
    "reward_mode": "reward_mode_initial",
    "difficulty_level": "difficulty_level",
    "kaggle_dataset": "kaggle_dataset_name",
}


def harbor_reward(environments: list[Any] | None = None, environment_reward: list[Any] | None = None, **_: Any):
    """Reward function of a Harbor run: each row's environment verifier reward (`environment_reward`, when a caller
    passes those values directly, takes precedence)."""
    if environment_reward is not None:
        return [float(value) for value in environment_reward]
    return [float(env.reward) for env in environments or []]


def _load_class(reference: str) -> Any:
    """`"pkg.module:Class"` or `"path/to/file.py:Class"` -> the class."""
    location, _, name = reference.rpartition(":")
    if location.endswith(".py"):
        path = Path(location)
        spec = importlib.util.spec_from_file_location(f"_harbor_agent_{path.stem}", path)
        if spec is None or not path.is_file():
            raise ValueError(f"agent={reference!r}: no Python file at {location!r}.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(location)
    try:
        return getattr(module, name)
    except AttributeError as error:
        raise ValueError(f"agent={reference!r}: {location!r} defines no {name!r}.") from error


def resolve_agent(agent: str | type) -> type[HarborEnv]:
    """The environment class named by `agent`: a key of `AGENTS`, `"pkg.module:Class"`, `"path/file.py:Class"` or a
    class; it must subclass `HarborEnv`."""
    if isinstance(agent, str):
        if agent in AGENTS:
            agent = AGENTS[agent]
        elif ":" in agent:
            agent = _load_class(agent)
        else:
            raise ValueError(
                f"agent={agent!r} is neither a built-in agent ({sorted(AGENTS)}) nor a 'pkg.module:Class' / "
                "'path/file.py:Class' reference."
            )
    if not (isinstance(agent, type) and issubclass(agent, HarborEnv)):
        raise TypeError(f"The Harbor agent must be a subclass of HarborEnv; got {agent!r}.")
    return agent


class HarborSpec:
    """A set of Harbor tasks, ready to plug into `GRPOTrainer`.

    ```python
    spec = HarborSpec("path/to/tasks", num_tasks=64)
    trainer = GRPOTrainer(
        model=...,
        reward_funcs=spec.reward_funcs,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        args=GRPOConfig(...),
    )
    ```

    Args:
        dataset: A local directory holding `tasks/` or task directories (`*/task.toml`), or a Hugging Face dataset
            repository whose `tasks/` folder is downloaded.
        agent: The environment class: a key of `AGENTS` (`"bash"`), `"pkg.module:Class"`, `"path/file.py:Class"` or
            a `HarborEnv` subclass.
        environment_type: Harbor backend the sandboxes run on.
        num_tasks: Use the first `num_tasks` tasks (sorted by directory name).
        indices: Use these task positions instead (not together with `num_tasks`).
        include_metadata: Add the `[metadata]` columns of each `task.toml` to the dataset.
    """

    def __init__(
        self,
        dataset: str,
        *,
        agent: str | type[HarborEnv] = "bash",
        environment_type: str = "docker",
        num_tasks: int | None = None,
        indices: list[int] | None = None,
        include_metadata: bool = True,
    ):
        if num_tasks is not None and indices is not None:
            raise ValueError("Pass num_tasks or indices, not both.")
        self.dataset = dataset
        self.agent = resolve_agent(agent)
        self.environment_type = environment_type
        self.num_tasks = num_tasks
        self.indices = indices
        self.include_metadata = include_metadata

    def _tasks_root(self) -> Path:
        local = Path(self.dataset)
        if local.is_dir():
            return local / "tasks" if (local / "tasks").is_dir() else local
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(repo_id=self.dataset, repo_type="dataset", allow_patterns=["tasks/**"])
        return Path(snapshot) / "tasks"

    def task_dirs(self) -> list[Path]:
        """The selected task directories, in order."""
        found = sorted(path for path in self._tasks_root().iterdir() if (path / "task.toml").is_file())
        if self.indices is not None:
            found = [found[i] for i in self.indices]
        elif self.num_tasks is not None:
            found = found[: self.num_tasks]
        if not found:
            raise ValueError(f"No Harbor task (a directory with task.toml) found in {self.dataset!r}.")
        return found

    @functools.cached_property
    def train_dataset(self) -> Any:
        """One row per task: an empty user message as `prompt` (the instruction comes from `reset`), `task_dir`,
        `task_index` and, with `include_metadata`, `gold_answer`, `reward_mode`, `difficulty_level`,
        `kaggle_dataset`."""
        from datasets import Dataset

        if self.include_metadata:
            try:
                import tomllib
            except ImportError:  # Python 3.10 (Harbor itself needs 3.12)
                import tomli as tomllib
        rows = []
        for index, task_dir in zip(self.indices or range(10**9), self.task_dirs()):
            row = {"prompt": [{"role": "user", "content": ""}], "task_dir": str(task_dir), "task_index": index}
            if self.include_metadata:
                metadata = tomllib.loads((task_dir / "task.toml").read_text()).get("metadata", {})
                row.update({column: metadata.get(key) for column, key in _METADATA_COLUMNS.items()})
            rows.append(row)
        return Dataset.from_list(rows)

    @functools.cached_property
    def environment_factory(self) -> functools.partial:
        """Zero-argument, picklable factory of the agent's environments."""
        return functools.partial(self.agent, environment_type=self.environment_type)

    @property
    def reward_funcs(self) -> list[Any]:
        """`[harbor_reward]`: each rollout's verifier reward."""
        return [harbor_reward]

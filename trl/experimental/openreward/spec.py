"""`OpenRewardSpec`: an OpenReward (ORS) environment as the three things GRPO needs (`train_dataset`,
`environment_factory`, `reward_funcs`)."""

from __future__ import annotations

import functools
import os
from typing import Any

from ...import_utils import is_openreward_available
from .environment import _RolloutEnvironment, make_tool_method


def openreward_reward(environments: list[Any] | None = None, **_: Any) -> list[float | None]:
    """Reward function of an OpenReward run: each row's last tool reward (None where no tool returned one)."""
    return [env.reward for env in environments or []]


class OpenRewardSpec:
    """An OpenReward environment's tasks, ready to plug into `GRPOTrainer`.

    ```python
    spec = OpenRewardSpec("Eigent/SETA", num_tasks=32)
    trainer = GRPOTrainer(
        model=...,
        reward_funcs=spec.reward_funcs,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        args=GRPOConfig(...),
    )
    ```

    Args:
        target: An openreward.ai catalog name, or the URL of an ORS server (anything containing `://`).
        num_tasks: Use the first `num_tasks` tasks of the split.
        split: The task split.
        indices: Use these task indices instead (not together with `num_tasks`).
        api_key: OpenReward API key (catalog mode; default: the `OPENREWARD_API_KEY` environment variable).
        secrets: Secrets sent with each session (catalog mode default: `{"api_key": api_key}`).
        env_name: Environment name on an ORS server (default `"env"`).
        include_metadata: Add the task-spec fields as dataset columns.
        discover_task_tools: Build the tool methods from per-task sessions (`list_tools()` of a task session)
            rather than from the environment's shared tool list.
        task_tools_discovery_index: The task whose session is probed for tools (default: each index of `indices`,
            else task 0).
    """

    def __init__(
        self,
        target: str,
        *,
        num_tasks: int | None = None,
        split: str = "train",
        indices: list[int] | None = None,
        api_key: str | None = None,
        secrets: dict[str, str] | None = None,
        env_name: str | None = None,
        include_metadata: bool = True,
        discover_task_tools: bool = True,
        task_tools_discovery_index: int | None = None,
    ):
        if num_tasks is not None and indices is not None:
            raise ValueError("Pass num_tasks or indices, not both.")
        self.target = target
        self.num_tasks = num_tasks
        self.split = split
        self.indices = indices
        self.is_server = "://" in target
        self.api_key = api_key if api_key is not None or self.is_server else os.environ.get("OPENREWARD_API_KEY")
        self.secrets = secrets if secrets is not None else ({} if self.is_server else {"api_key": self.api_key})
        self.env_name = env_name
        self.include_metadata = include_metadata
        self.discover_task_tools = discover_task_tools
        self.task_tools_discovery_index = task_tools_discovery_index

    @functools.cached_property
    def environment(self) -> Any:
        """The ORS environment handle (`openreward.OpenReward(...).environments.get(...)`)."""
        if not is_openreward_available():
            raise ImportError("OpenRewardSpec needs the `openreward` package: `pip install trl[openreward]`.")
        import openreward

        if self.is_server:
            client = openreward.OpenReward(api_key=self.api_key, base_url=self.target)
            return client.environments.get(self.env_name or "env")
        client = openreward.OpenReward(api_key=self.api_key, base_url=None)
        return client.environments.get(self.target)

    def task_indices(self) -> list[int]:
        """The selected task indices of the split."""
        if self.indices is not None:
            return list(self.indices)
        total = self.environment.num_tasks(self.split)
        return list(range(total if self.num_tasks is None else min(self.num_tasks, total)))

    @functools.cached_property
    def train_dataset(self) -> Any:
        """One row per task: an empty user message as `prompt` (the text comes from `reset`), `task_index` and,
        with `include_metadata`, the task-spec fields (sorted by name)."""
        from datasets import Dataset

        rows = []
        specs = []
        for index in self.task_indices():
            rows.append({"prompt": [{"role": "user", "content": ""}], "task_index": index})
            if self.include_metadata:
                spec = getattr(self.environment.get_task(self.split, index), "task_spec", None) or {}
                specs.append({k: v for k, v in spec.items() if k not in ("prompt", "task_index")})
        if self.include_metadata:
            keys = sorted({key for spec in specs for key in spec})
            for row, spec in zip(rows, specs):
                row.update({key: spec.get(key) for key in keys})
        return Dataset.from_list(rows)

    def _tool_specs(self) -> list[Any]:
        """The ORS tool specs, merged by name over the probed task sessions (the shared list as a fallback)."""
        found: dict[str, Any] = {}
        if self.discover_task_tools:
            if self.task_tools_discovery_index is not None:
                probes = [self.task_tools_discovery_index]
            else:
                probes = list(dict.fromkeys(self.indices)) if self.indices is not None else [0]
            for index in probes:
                with self.environment.session(split=self.split, index=index, secrets=self.secrets) as session:
                    for spec in session.list_tools():
                        found.setdefault(spec.name, spec)
        if not found:
            for spec in self.environment.list_tools():
                found.setdefault(spec.name, spec)
        return list(found.values())

    @functools.cached_property
    def environment_factory(self) -> type:
        """Zero-argument factory (a class) of rollout environments with one method per ORS tool."""
        methods = {
            spec.name: make_tool_method(spec.name, spec.description, spec.input_schema) for spec in self._tool_specs()
        }
        attributes = {"_ors_env": self.environment, "_split": self.split, "_secrets": self.secrets, **methods}
        return type("OpenRewardEnvironment", (_RolloutEnvironment,), attributes)

    @property
    def reward_funcs(self) -> list[Any]:
        """`[openreward_reward]`: each rollout's last tool reward."""
        return [openreward_reward]

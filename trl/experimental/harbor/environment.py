"""Harbor task environments for GRPO's `environment_factory`: one sandbox per rollout row, driven through Harbor.

`HarborEnv.reset(task_dir=...)` starts the task's environment (Docker, or any backend Harbor supports), prepares it
and returns the task instruction; the tool methods of a subclass act in the sandbox (`HarborBashEnv.bash`); `reward`
runs the task's verifier once. Harbor (`pip install trl[harbor]`, Python >= 3.12) is imported only inside these
lifecycle methods, so the classes import, and their instances can be built, without it.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import tempfile
import uuid
from pathlib import Path
from typing import Any

from ...import_utils import is_harbor_available
from ...trainer.utils import shutdown_event_loop_in_daemon, start_event_loop_in_daemon


# Tool output longer than this many characters is cut (the model's context is the limit, not the sandbox's).
_MAX_OUTPUT_CHARS = 8000
_COPY_LINE = re.compile(r"^\s*COPY\s+(?!--from)(.+)$", re.IGNORECASE)


def _require_harbor() -> None:
    if not is_harbor_available():
        raise ImportError("Harbor environments need the `harbor` package (Python >= 3.12): `pip install trl[harbor]`.")


def _dockerfile_copies(environment_dir: Path) -> list[tuple[Path, str]]:
    """`(local source, destination)` of each plain `COPY src... dest` line of the task's Dockerfile."""
    dockerfile = environment_dir / "Dockerfile"
    if not dockerfile.is_file():
        return []
    copies = []
    for line in dockerfile.read_text().splitlines():
        match = _COPY_LINE.match(line)
        if not match:
            continue
        parts = [part for part in shlex.split(match.group(1)) if not part.startswith("--")]
        if len(parts) < 2:
            continue
        *sources, destination = parts
        for source in sources:
            path = environment_dir / source
            if path.exists():
                target = destination
                if destination.endswith("/") or len(sources) > 1:
                    target = destination.rstrip("/") + "/" + path.name
                copies.append((path, target))
    return copies


class HarborEnv:
    """Base class of a Harbor task environment (one instance per rollout row).

    A subclass adds tool methods (public methods with typed arguments and a Google-style docstring), may set
    `PROMPT_SUFFIX` (appended to the task instruction) and may override `_setup()` (run after each start). The
    instance owns an asyncio loop on a daemon thread, on which Harbor's asynchronous calls run.

    Args:
        environment_type: Harbor backend (`"docker"`, `"daytona"`, `"modal"`, ...).
    """

    PROMPT_SUFFIX = ""

    def __init__(self, environment_type: str = "docker"):
        self.environment_type = environment_type
        self._thread = self._loop = None
        self._environment = self._task = self._trial_paths = None
        self._reward: float | None = None

    # ------------------------------------------------------------------------------------------------------------
    # Lifecycle
    # ------------------------------------------------------------------------------------------------------------
    def reset(self, task_dir: str | None = None, **kwargs: Any) -> str:
        """Start a fresh sandbox for the task in `task_dir` and return its instruction (plus `PROMPT_SUFFIX`).

        Any previous sandbox of this instance is stopped first. The Dockerfile's `COPY` files are uploaded again
        (backends that do not build from the Dockerfile context need them), the task's healthcheck is run,
        `/workdir` and `/home/user/input` are created and `_setup()` is called.
        """
        if task_dir is None:
            raise ValueError("HarborEnv.reset needs the task directory: pass task_dir (a HarborSpec dataset column).")
        self._stop()
        self._reward = None
        self._run(self._start(Path(task_dir)))
        self._setup()
        return self._task.instruction + self.PROMPT_SUFFIX

    @property
    def reward(self) -> float:
        """The task verifier's reward (run once per reset and cached); 0.0 before any reset."""
        if self._reward is None:
            self._reward = 0.0 if self._environment is None else self._verify()
        return self._reward

    async def _start(self, task_dir: Path) -> None:
        _require_harbor()
        from harbor.environments.factory import EnvironmentFactory
        from harbor.models.environment_type import EnvironmentType
        from harbor.models.task.task import Task
        from harbor.models.trial.paths import TrialPaths

        self._task = Task(task_dir)
        self._trial_paths = TrialPaths(Path(tempfile.mkdtemp(prefix="trl-harbor-")))
        self._environment = EnvironmentFactory.create_environment(
            EnvironmentType(self.environment_type),
            self._task.paths.environment_dir,
            self._task.name,
            f"trl-{uuid.uuid4().hex[:12]}",
            self._trial_paths,
            self._task.config.environment,
        )
        await self._environment.start(force_build=False)
        for source, destination in _dockerfile_copies(Path(self._task.paths.environment_dir)):
            upload = self._environment.upload_dir if source.is_dir() else self._environment.upload_file
            await upload(source, destination)
        if getattr(self._task.config.environment, "healthcheck", None) is not None:
            await self._environment.run_healthcheck()
        await self._environment.exec("mkdir -p /workdir /home/user/input")

    def _setup(self) -> None:
        """Hook run after each start (install tools, stage files); does nothing by default."""

    def _exec(self, command: str, timeout: int = 180) -> str:
        """Run a shell command in the sandbox; returns stdout and stderr (cut to 8000 characters), or a note with
        the return code when there is no output."""
        if self._environment is None:
            raise RuntimeError("The environment is not started: call reset(task_dir=...) first.")
        result = self._run(self._environment.exec(command, timeout_sec=timeout))
        output = (result.stdout or "") + (result.stderr or "")
        if not output.strip():
            return f"(no output; return code {result.return_code})"
        return output[:_MAX_OUTPUT_CHARS]

    def _verify(self) -> float:
        """Run the task's tests; the `reward` entry of the verifier's rewards, or the first one (0.0 if none)."""
        from harbor.verifier.verifier import Verifier

        result = self._run(Verifier(self._task, self._trial_paths, self._environment).verify())
        rewards = getattr(result, "rewards", None) or {}
        if "reward" in rewards:
            return float(rewards["reward"])
        return float(next(iter(rewards.values()), 0.0))

    def _stop(self) -> None:
        """Stop and delete the current sandbox, if any."""
        if self._environment is not None:
            environment, self._environment = self._environment, None
            self._run(environment.stop(delete=True))

    def _run(self, coroutine: Any) -> Any:
        """Run a coroutine on this instance's loop thread (started on first use) and return its result."""
        if self._loop is None:
            self._thread, self._loop, ready = start_event_loop_in_daemon(name=f"harbor-{id(self):x}")
            ready.wait()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __del__(self):
        try:
            self._stop()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
        shutdown_event_loop_in_daemon(self._thread, self._loop)


class HarborBashEnv(HarborEnv):
    """A Harbor environment with one tool, `bash`; the answer is submitted by writing `/workdir/answer.txt`."""

    PROMPT_SUFFIX = (
        "\n\nUse the bash tool to work in the sandbox. When you are done, write your final answer to "
        "/workdir/answer.txt."
    )

    def bash(self, command: str) -> str:
        """Run a bash command in the task's sandbox.

        Args:
            command: The command line to run.

        Returns:
            The command's output (stdout and stderr).
        """
        return self._exec(command)


AGENTS: dict[str, type[HarborEnv]] = {"bash": HarborBashEnv}

"""Rollout environments over an Open Reward Standard (ORS) environment: one ORS session per rollout row, its tools
exposed as methods of a generated class so that GRPO's tool loop can call them."""

from __future__ import annotations

import inspect
import keyword
from typing import Any


_JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


def _blocks_text(blocks: Any) -> str:
    """The text of a list of ORS content blocks (image blocks are skipped), one block per line."""
    return "\n".join(getattr(block, "text", "") for block in blocks or [] if getattr(block, "text", None) is not None)


def _python_type(schema: dict[str, Any]) -> Any:
    """Python annotation for a JSON-schema property (`anyOf` / `oneOf` take their first typed option; a default's
    type stands in for a missing `type`; `str` otherwise)."""
    json_type = schema.get("type")
    if isinstance(json_type, list):
        json_type = next((t for t in json_type if t != "null"), None)
    if json_type is None:
        for option in schema.get("anyOf") or schema.get("oneOf") or []:
            if isinstance(option, dict) and option.get("type") not in (None, "null"):
                return _python_type(option)
        if "default" in schema and schema["default"] is not None:
            return type(schema["default"])
        return str
    return _JSON_TYPES.get(json_type, str)


def make_tool_method(name: str, description: str, input_schema: dict[str, Any] | None) -> Any:
    """A method `(self, **arguments) -> str` calling the ORS tool `name`, with a signature, annotations and a
    Google-style docstring built from its JSON schema (required parameters first), so that tool-calling chat
    templates can describe it."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"ORS tool name {name!r} is not a Python identifier, so it cannot become a tool method.")
    schema = input_schema or {}
    properties = schema.get("properties") or {}
    required = [key for key in schema.get("required") or [] if key in properties]
    ordered = required + [key for key in properties if key not in required]
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {"return": str}
    arg_lines = []
    for key in ordered:
        prop = properties[key] if isinstance(properties[key], dict) else {}
        annotation = _python_type(prop)
        default = inspect.Parameter.empty if key in required else prop.get("default")
        parameters.append(
            inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
        )
        annotations[key] = annotation
        arg_lines.append(f"    {key}: {prop.get('description') or key}")

    def tool(self, **arguments: Any) -> str:
        return self._call_tool(name, arguments)

    tool.__name__ = tool.__qualname__ = name
    tool.__signature__ = inspect.Signature(parameters, return_annotation=str)
    tool.__annotations__ = annotations
    doc = (description or f"Call the {name} tool.").strip()
    if arg_lines:
        doc += "\n\nArgs:\n" + "\n".join(arg_lines)
    tool.__doc__ = doc + "\n\nReturns:\n    The tool's output."
    return tool


class _RolloutEnvironment:
    """Base of the generated environment classes: holds one ORS session and the results of its tool calls.

    Subclasses are built by `OpenRewardSpec.environment_factory` with the class attributes `_ors_env` (an ORS
    environment handle), `_split` and `_secrets`, and one method per ORS tool.
    """

    _ors_env: Any = None
    _split: str = "train"
    _secrets: dict[str, str] | None = None

    def __init__(self):
        self._session = None
        self.rewards: list[float | None] = []
        self.metadata: dict[str, Any] = {}
        self.finished = False
        self.last_output: str | None = None

    def reset(self, *, task_index: int = 0, task_spec: Any = None, **_: Any) -> str:
        """Close any previous session, open one on the task (`task_index` of the split, or a `Task` given as
        `task_spec`) and return its prompt text."""
        self._close()
        self.rewards, self.metadata, self.finished, self.last_output = [], {}, False, None
        if task_spec is not None and not isinstance(task_spec, dict):
            session = self._ors_env.session(task=task_spec, secrets=self._secrets)
        else:
            session = self._ors_env.session(split=self._split, index=int(task_index), secrets=self._secrets)
        self._session = session.__enter__()
        return _blocks_text(self._session.get_prompt())

    @property
    def reward(self) -> float | None:
        """The last reward a tool call returned (None if none did)."""
        return next((r for r in reversed(self.rewards) if r is not None), None)

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if self._session is None:
            return "Error: the environment has no open session; reset() must run first."
        try:
            output = self._session.call_tool(name, arguments)
        except Exception as error:  # noqa: BLE001 - the model sees the failure as the tool's answer
            return f"Error: {type(error).__name__}: {error}"
        self.rewards.append(getattr(output, "reward", None))
        self.metadata.update(getattr(output, "metadata", None) or {})
        self.finished = self.finished or bool(getattr(output, "finished", False))
        self.last_output = _blocks_text(getattr(output, "blocks", None))
        return self.last_output

    def _close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            try:
                session.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - a session that fails to close must not stop the next rollout
                pass

    def __del__(self):
        self._close()

"""Test stand-in of `openenv.core.harness` (openenv-core 0.3.0's trainer-facing interface)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from ..llm_client import LLMResponse


@dataclass
class Tool:
    """OpenEnv's MCP tool description (a pydantic model there)."""

    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass
class ToolResult:
    data: Any = None
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class VerifyResult:
    env_reward: float | None = None
    done: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolTraceEntry:
    tool_name: str
    arguments: dict[str, Any]
    result: ToolResult


@dataclass
class ModelStepResult:
    response: LLMResponse
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class HarnessRolloutResult:
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_trace: list[ToolTraceEntry] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    done: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class HarnessRunLimits:
    max_turns: int = 10
    max_tool_calls_per_turn: int | None = None
    max_total_tool_calls: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


class ResourceSession(ABC):
    @abstractmethod
    def initial_messages(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    def list_tools(self) -> list[Tool]: ...

    @abstractmethod
    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult: ...

    @abstractmethod
    def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> VerifyResult: ...

    @abstractmethod
    def close(self) -> None: ...


class ResourceSessionFactory(ABC):
    @abstractmethod
    def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> ResourceSession: ...


class HarnessAdapter(ABC):
    @abstractmethod
    def run_white_box(self, model_step, session, limits=None) -> HarnessRolloutResult: ...

    @abstractmethod
    def run_black_box(self, session, limits=None) -> HarnessRolloutResult: ...


class MCPHarnessAdapter(HarnessAdapter):
    """The white-box MCP loop: sample a turn, run its tool calls on the session, append the results, repeat until a
    turn calls no tool, a tool result says `done`, or `max_turns` turns were sampled."""

    def run_white_box(self, model_step, session, limits=None) -> HarnessRolloutResult:
        limits = limits or HarnessRunLimits()
        messages = list(session.initial_messages())
        tools = session.list_tools()
        result = HarnessRolloutResult(messages=list(messages))
        for _ in range(limits.max_turns):
            step = model_step(messages, tools, dict(limits.sampling))
            messages.append(step.response.to_message_dict())
            result.prompt_ids += step.prompt_ids
            result.completion_ids += step.completion_ids
            result.logprobs += step.logprobs
            if not step.response.tool_calls:
                result.done = True
                break
            for call in step.response.tool_calls:
                tool_result = session.call_tool(call.name, dict(call.args))
                result.tool_trace.append(ToolTraceEntry(call.name, dict(call.args), tool_result))
                data = tool_result.data
                content = "" if data is None else data if isinstance(data, str) else json.dumps(data, sort_keys=True)
                messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content})
                if tool_result.done:
                    result.done = True
                    break
            if result.done:
                break
        result.messages = list(messages)
        return result

    def run_black_box(self, session, limits=None) -> HarnessRolloutResult:
        raise NotImplementedError("MCPHarnessAdapter is a white-box harness.")

"""Tool calls (OpenAI's ``tools`` / ``tool_choice``) on a model whose chat template knows no tools.

A tool call is structured output with a fixed shape: the model answers with a JSON object
``{"name": <a tool's name>, "arguments": <an object valid against that tool's parameters>}``.
So the server

1. tells the model about the tools: a system message lists each tool as one line of JSON and
   says how to call one (SmolLM2's ChatML template has no slot for tools; a template that does
   would render them itself);
2. constrains the answer when a call is required: ``tool_choice`` ``"required"`` is a JSON Schema
   ``anyOf`` over the tools' call objects, a named function is that one tool's call object; the
   arguments follow the tool's ``parameters`` schema (the same subset and limits as
   ``response_format``). ``"auto"`` leaves the model free: an answer that parses as a call of a
   listed tool becomes one, anything else stays text. ``"none"``: the tools are not shown;
3. returns the call as ``tool_calls`` with ``finish_reason: "tool_calls"``, whole (a streamed
   call arrives in one delta at the end: the text cannot be told from a call before it ends).

One call per turn: ``parallel_tool_calls`` is accepted and answered with at most one call.
Earlier turns come back as the client sends them: an assistant message's ``tool_calls`` are
rendered as the JSON the model wrote, a ``tool`` message as a turn of the ``tool`` role.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 64
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CALL_INSTRUCTIONS = (
    "You can call the tools below. To call one, answer with only a JSON object of the form "
    '{"name": <the tool\'s name>, "arguments": <an object of its parameters>} and nothing else. '
    "Tools, one per line:"
)


class ToolError(ValueError):
    """A malformed ``tools`` or ``tool_choice``; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]

    def call_schema(self) -> dict[str, Any]:
        """The JSON Schema of a call of this tool: its name, then its arguments."""
        return {"type": "object", "properties": {"name": {"enum": [self.name]}, "arguments": dict(self.parameters)},
                "required": ["name", "arguments"]}


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one request and what ``tool_choice`` asks: "auto", "required" or one tool's name."""

    tools: tuple[Tool, ...]
    choice: str

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any) -> ToolPlan | None:
        """From the request's fields; None when no tool may be called (no tools, or "none")."""
        if tools is None or tools == []:
            if tool_choice not in (None, "none", "auto"):
                raise ToolError("tool_choice needs tools", "tool_choice")
            return None
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise ToolError(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
        parsed = tuple(_tool(spec, i) for i, spec in enumerate(tools))
        names = [t.name for t in parsed]
        if len(set(names)) != len(names):
            raise ToolError("tools: two functions have the same name", "tools")
        if tool_choice is None or tool_choice == "auto":
            return cls(parsed, "auto")
        if tool_choice == "none":
            return None
        if tool_choice == "required":
            return cls(parsed, "required")
        if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
            name = (tool_choice.get("function") or {}).get("name")
            if name in names:
                return cls(parsed, name)
            raise ToolError(f"tool_choice names a function that is not in tools: {str(name)[:64]!r}", "tool_choice")
        raise ToolError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                        "'function': {'name': ...}}", "tool_choice")

    def system_prompt(self) -> str:
        lines = [json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                            ensure_ascii=False) for t in self.tools]
        return "\n".join([CALL_INSTRUCTIONS, *lines])

    def response_format(self) -> dict[str, Any] | None:
        """The constraint of a required call, as a response_format; None for "auto"."""
        if self.choice == "auto":
            return None
        chosen = [t for t in self.tools if self.choice in ("required", t.name)]
        schema = chosen[0].call_schema() if len(chosen) == 1 else {"anyOf": [t.call_schema() for t in chosen]}
        return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The answer as OpenAI ``tool_calls`` if it is a call of one of the tools, else None."""
        try:
            value = json.loads(text.strip())
        except ValueError:
            return None
        names = {t.name for t in self.tools}
        if not isinstance(value, dict) or value.get("name") not in names or not isinstance(value.get("arguments"), dict):
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": value["name"], "arguments": json.dumps(value["arguments"], ensure_ascii=False)}}]


def with_tools(messages: list[dict[str, str]], plan: ToolPlan | None) -> list[dict[str, str]]:
    """``messages`` with the tools described in the system message (added first if there is none)."""
    if plan is None:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + plan.system_prompt()}, *messages[1:]]
    return [{"role": "system", "content": plan.system_prompt()}, *messages]


def render_calls(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """An earlier assistant turn's ``tool_calls`` as the text the model writes for a call."""
    rendered = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass  # shown as the client sent it
        rendered.append(json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False))
    return "\n".join(rendered)


def _tool(spec: Any, i: int) -> Tool:
    where = f"tools.{i}"
    if not isinstance(spec, Mapping) or spec.get("type") != "function" or not isinstance(spec.get("function"), Mapping):
        raise ToolError(f"{where}: expected {{'type': 'function', 'function': {{'name': ...}}}}", where)
    function = spec["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'", f"{where}.function.name")
    description = function.get("description") or ""
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(description, str) or not isinstance(parameters, Mapping):
        raise ToolError(f"{where}.function: description must be a string and parameters an object", where)
    return Tool(name, description, parameters)

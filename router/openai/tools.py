"""Chat `tools` / `tool_choice`: what the model may call and how its output is read.

`none`: the tools are only shown to the model (through the chat template) and its output
is plain content. `auto`: the output is content unless it is a tool call in the chat
template's format (Llama 3 JSON or Hermes `<tool_call>`, see tool_parsers.py). `required`
and a named function are enforced by a grammar, so every call's arguments parse and
validate against the function's JSON schema: a named choice generates the arguments
object itself, `required` a JSON list of `{"name", "arguments"}` objects.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from tandem.engine.structured.spec import GuidedDecoding
from tandem.router.json_fields import invalid, show
from tandem.router.structured_outputs import checked

# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_NUM_TOOLS = 128
# A function without `parameters` takes an empty object.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolChoice(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str | None
    # The arguments' JSON schema.
    parameters: dict[str, Any]

    def template_json(self) -> dict[str, Any]:
        """The tool as chat templates (and OpenAI) describe it."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools and how the model's output relates to them."""

    functions: tuple[ToolFunction, ...]
    choice: ToolChoice
    # The function of a named choice.
    named: ToolFunction | None = None
    # `parallel_tool_calls`: with `required`, more than one call may be made.
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    def template_tools(self) -> list[dict[str, Any]]:
        return [f.template_json() for f in self.functions]

    def guided(self) -> GuidedDecoding | None:
        """The grammar that forces the output to be the call(s); None for none/auto."""
        if self.choice is ToolChoice.NAMED and self.named is not None:
            return checked("tool_choice", GuidedDecoding.json_schema(self.named.parameters))
        if self.choice is ToolChoice.REQUIRED:
            schema = required_calls_schema(self.functions, self.parallel)
            # Each tool's schema builds alone (checked when parsed); so should their list.
            return checked("tool_choice", GuidedDecoding.json_schema(schema))
        return None


def required_calls_schema(functions: tuple[ToolFunction, ...], parallel: bool) -> dict[str, Any]:
    """A non-empty JSON list of calls, each `{"name": <a tool>, "arguments": <its args>}`.

    Each tool's parameters schema goes under the list's `$defs` (as `<name>`, its own
    definitions as `<name>.<definition>`, its `$ref`s renamed to match): nested as they
    are, their `#/$defs/...` and `#` references would point into the list's schema."""
    definitions: dict[str, Any] = {}
    calls = []
    for f in functions:
        definitions.update(_lifted(f.name, f.parameters))
        calls.append({
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": {"$ref": f"#/$defs/{f.name}"}},
            "required": ["name", "arguments"],
        })  # fmt: skip
    schema: dict[str, Any] = {
        "$defs": definitions,
        "type": "array",
        "items": {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _lifted(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """`parameters` and its local definitions as entries of another schema's `$defs`."""
    local = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    renamed = {f"{name}.{key}": _with_refs_renamed(value, name) for key, value in local.items()}
    root = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    return {name: _with_refs_renamed(root, name), **renamed}


def _with_refs_renamed(node: Any, name: str) -> Any:
    """`node` with each local `$ref` pointing where `_lifted` moved its target."""
    if isinstance(node, list):
        return [_with_refs_renamed(item, name) for item in node]
    if not isinstance(node, dict):
        return node
    renamed = {key: _with_refs_renamed(value, name) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        parts = ref[2:].split("/") if ref != "#" else []
        if len(parts) >= 2 and parts[0] in ("$defs", "definitions"):
            target = [f"{name}.{_unescaped(parts[1])}", *parts[2:]]
        else:
            target = [name, *parts]
        renamed["$ref"] = "#/$defs/" + "/".join([_escaped(target[0]), *target[1:]])
    return renamed


def _unescaped(token: str) -> str:  # JSON pointer (RFC 6901)
    return token.replace("~1", "/").replace("~0", "~")


def _escaped(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def parse_tools(body: dict[str, Any]) -> ToolPlan | None:
    """The request's `tools` and `tool_choice`, validated (None: no tools)."""
    raw_tools = body.get("tools")
    raw_choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", f"must be true or false, got {show(parallel)}")
    if raw_tools is None or raw_tools == []:
        if raw_choice not in (None, "none", "auto"):
            raise invalid("tool_choice", "needs 'tools' to choose from")
        return None
    if not isinstance(raw_tools, list):
        raise invalid("tools", f"must be a list of tool objects, got {show(raw_tools)}")
    if len(raw_tools) > MAX_NUM_TOOLS:
        raise invalid("tools", f"may hold at most {MAX_NUM_TOOLS} tools, got {len(raw_tools)}")
    functions = tuple(_function(i, tool) for i, tool in enumerate(raw_tools))
    names = [f.name for f in functions]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise invalid("tools", f"name the function {show(duplicate)} more than once")
    choice, named = _choice(raw_choice, {f.name: f for f in functions})
    return ToolPlan(functions, choice, named, parallel)


def _function(index: int, tool: Any) -> ToolFunction:
    label = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(f"{label}.type", f"must be 'function', got {show(tool)}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{label}.function", f"must be an object, got {show(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid(
            f"{label}.function.name",
            f"must be 1-64 letters, digits, '_' or '-', got {show(name)}",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{label}.function.description", f"must be a string, got {show(description)}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(_NO_PARAMETERS)
    field = f"{label}.function.parameters"
    if not isinstance(parameters, dict):
        raise invalid(field, f"must be a JSON schema object, got {show(parameters)}")
    # A schema the grammar cannot build is refused now, whatever the tool_choice; one
    # with keywords a grammar cannot hold only when the call is forced (guided()).
    checked(field, GuidedDecoding.json_schema(parameters), enforced=False)
    if parameters.get("type", "object") != "object":
        # The arguments are a JSON object (OpenAI refuses other root types too).
        raise invalid(field, f"must describe an object ('type': 'object'), got {show(parameters)}")
    # Said outright, so a forced call's grammar makes an object of one that leaves it out.
    return ToolFunction(name, description, {**parameters, "type": "object"})


def _choice(raw: Any, functions: dict[str, ToolFunction]) -> tuple[ToolChoice, ToolFunction | None]:
    if raw is None:
        return ToolChoice.AUTO, None
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise invalid(
                "tool_choice",
                f"must be 'none', 'auto', 'required' or a function object, got {show(raw)}",
            )
        return ToolChoice(raw), None
    function = raw.get("function") if isinstance(raw, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(name, str):
        raise invalid(
            "tool_choice",
            "must be 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {show(raw)}",
        )
    if name not in functions:
        raise invalid("tool_choice.function.name", f"names no tool in 'tools': {show(name)}")
    return ToolChoice.NAMED, functions[name]

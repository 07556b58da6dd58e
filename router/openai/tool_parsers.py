"""Reading tool calls out of a model's text, per `tool_choice`.

Forced choices produce grammar-shaped text (tools.py), so they parse unless max_tokens
cuts them short. `auto` recognises the two formats chat templates teach models: Hermes /
Qwen (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number) and Llama 3
JSON (the whole reply is `{"name": ..., "parameters": {...}}`, or a list of them). A
call naming no declared tool, or text that does not parse, stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.router.openai.call_scanner import CallListScanner
from tandem.router.openai.tools import ToolChoice, ToolPlan

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.S)


@dataclass
class ToolCall:
    name: str
    # The arguments as a JSON object text (what OpenAI sends in `arguments`).
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def json(self, index: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return body if index is None else {"index": index, **body}


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ToolCall]


def parse_output(plan: ToolPlan, text: str) -> ParsedOutput:
    """The reply split into content and tool calls, according to `plan.choice`."""
    if plan.choice is ToolChoice.NONE:
        return ParsedOutput(text, [])
    if plan.choice is ToolChoice.NAMED and plan.named is not None:
        return ParsedOutput(None, [ToolCall(plan.named.name, text)])
    if plan.choice is ToolChoice.REQUIRED:
        calls = required_calls(plan, text)
        return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])
    parsed = _parse_auto(plan, text)
    if not plan.parallel and len(parsed.calls) > 1:
        # parallel_tool_calls false: at most one call, as OpenAI (the first one made).
        parsed.calls = parsed.calls[:1]
    return parsed


def required_calls(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The calls of a whole `required` reply; [] when it is not a list of calls of
    declared tools (cut short by max_tokens)."""
    return _calls_in(text, plan.names, args_keys=("arguments",))


def _parse_auto(plan: ToolPlan, text: str) -> ParsedOutput:
    hermes = parse_hermes(plan, text)
    if hermes.calls:
        return hermes
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        calls = _calls_in(stripped, plan.names)
        if calls:
            return ParsedOutput(None, calls)
    return ParsedOutput(text, [])


def parse_hermes(plan: ToolPlan, text: str) -> ParsedOutput:
    """The Hermes `<tool_call>` blocks of `text` that call a declared tool, and the rest
    (other blocks included) as content."""
    calls: list[ToolCall] = []

    def take(block: re.Match[str]) -> str:
        found = _calls_in(block[1], plan.names)
        calls.extend(found)
        return "" if found else block[0]

    rest = _HERMES_CALL.sub(take, text).strip() if HERMES_OPEN in text else text
    return ParsedOutput(rest or None, calls) if calls else ParsedOutput(text, [])


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls_in(
    text: str, names: frozenset[str], args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> list[ToolCall]:
    """The calls of a JSON call object or list of them (`_calls_from_json`), each with its
    arguments' text as generated where that is an object, as a stream sends it
    (`call_scanner`); arguments written as a JSON string are decoded."""
    calls = _calls_from_json(_loads(text), names, args_keys)
    if not calls:
        return []
    scanner = CallListScanner(args_keys)
    if text.lstrip().startswith("{"):
        scanner.feed("[")  # one call: read as a list of one
    scanner.feed(text)
    if len(scanner.calls) == len(calls):
        for call, (_, generated) in zip(calls, scanner.calls, strict=True):
            call.arguments = generated or call.arguments
    return calls


def _calls_from_json(
    value: Any, names: frozenset[str], args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> list[ToolCall]:
    """Calls from `{"name", "arguments"|"parameters"}` objects (one or a list); [] when
    anything in it is not such a call of a declared tool."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        arguments = arguments_json(item, args_keys)
        if arguments is None:
            return []
        calls.append(ToolCall(item["name"], arguments))
    return calls


def arguments_json(
    call: dict[str, Any], args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> str | None:
    """A call object's arguments as JSON object text (`{}` when it has none; decoded
    first where the model wrote them as a JSON string); None when they are no object."""
    key = next((k for k in args_keys if k in call), None)
    arguments = call.get(key) if key is not None else {}
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)

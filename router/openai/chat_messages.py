"""One chat message of a request → what the chat template takes.

Roles `system`, `developer`, `user`, `assistant` and `tool`. Content is a string or a
list of text parts. An assistant message may carry earlier `tool_calls` (content may
then be null) and a `tool` message answers one by `tool_call_id`: agent loops send both
back on every turn, and templates that know tools render them.
"""

from __future__ import annotations

import json
from typing import Any

from tandem.router.json_fields import invalid, show

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_message(index: int, message: Any) -> dict[str, Any]:
    label = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(label, f"must be an object with 'role' and 'content', got {show(message)}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        allowed = ", ".join(repr(r) for r in CHAT_ROLES)
        raise invalid(f"{label}.role", f"must be one of {allowed}; got {show(role)}")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        content = "\n".join(_text_part(f"{label}.content[{i}]", p) for i, p in enumerate(content))
    if not isinstance(content, str):
        raise invalid(
            f"{label}.content", f"must be a string or a list of text parts, got {show(content)}"
        )
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and message.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(f"{label}.tool_calls", message["tool_calls"])
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise invalid(
                f"{label}.tool_call_id",
                f"is required: the id of the tool call this answers, got {show(call_id)}",
            )
        out["tool_call_id"] = call_id
    return out


def _tool_calls(label: str, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise invalid(label, f"must be a list of tool calls, got {show(calls)}")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise invalid(
                f"{label}[{i}]",
                "must be {'id', 'type': 'function', 'function': {'name', 'arguments'}}, "
                f"got {show(call)}",
            )
        try:
            parsed = json.loads(arguments)
        except ValueError:
            raise invalid(
                f"{label}[{i}].function.arguments", f"must be JSON text, got {show(arguments)}"
            ) from None
        # Templates render arguments themselves (e.g. `| tojson`): give them the object.
        entry = {"type": "function", "function": {"name": name, "arguments": parsed}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _text_part(label: str, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise invalid(
            label, f"must be a text part {{'type': 'text', 'text': ...}}, got {show(part)}"
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise invalid(f"{label}.text", f"must be a string, got {show(text)}")
    return text

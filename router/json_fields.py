"""Typed reads of single JSON fields, each failing with a 400 that names the field.

JSON has one number type and `true` is not a number here: an int field takes only
integral JSON numbers, a float field any finite-or-not number (range checks are the
caller's), and neither takes a bool. `null` counts as absent, as in OpenAI's API.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from tandem.router.errors import InvalidRequest

# Longest rendering of a bad value inside an error message.
_MAX_SHOWN_CHARS = 60


def show(value: Any) -> str:
    """A bad value as the client wrote it (JSON), cut short if long."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3] + "..."
    return text


# A JSON escape of a UTF-16 surrogate, as raw body bytes: the only way one gets into a
# parsed body (raw UTF-8 cannot hold one), alone or as half of an escaped pair.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def check_text(raw: bytes, body: Any) -> None:
    """InvalidRequest naming a field of `body` (parsed from `raw`) whose text, or one of
    whose keys, holds a lone UTF-16 surrogate: JSON allows the escape "\\ud800", but it
    is not Unicode text, and no tokenizer, encoder or client takes it. Escaped pairs
    (an emoji from an ASCII-only JSON writer) are single characters once parsed."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str) and _SURROGATE.search(value):
            raise InvalidRequest(
                f"'{where or 'body'}' holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                "\\udfff escape); text must be valid Unicode",
                param=where or None,
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    raise InvalidRequest(
                        f"a key of '{where or 'body'}' holds a lone UTF-16 surrogate; keys "
                        "must be valid Unicode",
                        param=where or None,
                    )
                stack.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))


def invalid(name: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"'{name}' {message}", param=name)


def get_int(
    body: dict[str, Any],
    name: str,
    *,
    min_value: int | None = None,
    max_value: int | None = None,
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer, got {show(value)}")
    if min_value is not None and value < min_value:
        raise invalid(name, f"must be >= {min_value}, got {value}")
    if max_value is not None and value > max_value:
        raise invalid(name, f"must be <= {max_value}, got {value}")
    return value


def get_float(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, f"must be a number, got {show(value)}")
    if not math.isfinite(value):
        raise invalid(name, f"must be a finite number, got {show(value)}")
    return float(value)


def get_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(name, f"must be true or false, got {show(value)}")
    return value


def get_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid(name, f"must be a string, got {show(value)}")
    return value


def get_object(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(name, f"must be an object, got {show(value)}")
    return value


def get_str_list(body: dict[str, Any], name: str, max_len: int, max_chars: int) -> list[str]:
    """A string or a list of strings (like OpenAI's `stop`), as a list; [] when absent.
    At most `max_len` strings of at most `max_chars` characters each."""
    value = body.get(name)
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise invalid(name, f"must be a string or a list of strings, got {show(value)}")
    if len(items) > max_len:
        raise invalid(name, f"may hold at most {max_len} strings, got {len(items)}")
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise invalid(name, f"must hold non-empty strings, got {show(item)} at index {i}")
        if len(item) > max_chars:
            raise invalid(
                name,
                f"strings may hold at most {max_chars} characters, got {len(item)} at index {i}",
            )
    return list(items)


def get_int_list(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(name, f"must be a list of integers, got {show(value)}")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise invalid(name, f"must hold integers, got {show(item)} at index {i}")
    return list(value)


# At most 18 digits: any token id fits, and int() refuses strings past 4,300 digits.
_INTEGER_KEY = re.compile(r"-?[0-9]{1,18}")


def integer_key(key: str) -> int | None:
    """A JSON object key that spells an integer in ASCII digits ("5", "-1") as that int;
    None for anything else that int() would take too (" 5", "+5", "5_0", other
    scripts' digits such as "٥"), and for more than 18 digits."""
    return int(key) if _INTEGER_KEY.fullmatch(key) else None

"""`call_scanner`: a streamed JSON list of tool calls read into names and argument pieces."""

from __future__ import annotations

import json
import random

from tandem.router.openai.call_scanner import CallListScanner

# Braces, brackets, quotes and escapes inside strings; a call whose arguments come before
# its name; a name with an escape; whitespace between the list's own tokens.
REPLY = (
    '[ {"name": "get_weather", "arguments": {"city": "Pa\\"ri}s", "n": [1, {"a": "]"}]}},\n'
    '  {"arguments": {"x": "{\\\\"}, "name": "caf\\u00e9"} ]'
)
ARGUMENTS = ['{"city": "Pa\\"ri}s", "n": [1, {"a": "]"}]}', '{"x": "{\\\\"}']


def scan_in_pieces(text: str, rng: random.Random) -> tuple[dict[int, str], dict[int, str], int]:
    """Names and joined arguments per call, fed in random pieces; and the number of
    pieces that carried arguments text."""
    scanner = CallListScanner()
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    argument_pieces = 0
    at = 0
    while at < len(text):
        end = at + rng.randint(1, 9)
        for piece in scanner.feed(text[at:end]):
            if piece.name is not None:
                assert piece.index not in names, "a call is named once, on its first piece"
                names[piece.index] = piece.name
            assert piece.index in names, "no arguments before the call's name"
            arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
            argument_pieces += bool(piece.arguments)
        at = end
    assert scanner.calls == [(names[i], arguments[i]) for i in sorted(names)]
    return names, arguments, argument_pieces


def test_pieces_join_into_each_calls_arguments_as_generated():
    assert [call["arguments"] for call in json.loads(REPLY)] == [json.loads(a) for a in ARGUMENTS]
    rng = random.Random(0)
    for _ in range(300):
        names, arguments, pieces = scan_in_pieces(REPLY, rng)
        assert names == {0: "get_weather", 1: "café"}
        assert arguments == {0: ARGUMENTS[0], 1: ARGUMENTS[1]}
        assert pieces >= 2


def test_one_character_at_a_time_streams_arguments_as_they_grow():
    scanner = CallListScanner()
    fed = [scanner.feed(ch) for ch in '[{"name": "f", "arguments": {"a": 1}}]']
    pieces = [piece for batch in fed for piece in batch]
    assert pieces[0].name == "f" and pieces[0].arguments == ""
    assert "".join(p.arguments for p in pieces) == '{"a": 1}'
    assert all(p.name is None and len(p.arguments) == 1 for p in pieces[1:])


def test_a_reply_cut_short_has_only_the_calls_it_finished():
    scanner = CallListScanner()
    pieces = scanner.feed('[{"name": "f", "arguments": {}}, {"name": "g", "argum')
    assert [(p.index, p.name, p.arguments) for p in pieces] == [(0, "f", "{}"), (1, "g", "")]
    assert scanner.calls == [("f", "{}")]
    unnamed = CallListScanner()
    assert unnamed.feed('[{"arguments": {"a": 1}, "na') == [] and unnamed.calls == []

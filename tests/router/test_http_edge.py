"""The router's HTTP edge, over a loopback socket: requests aiohttp refuses before the
app sees them answer OpenAI error JSON (`router/http_protocol_errors.py`).

Raw bytes, not an HTTP client: these requests are malformed on purpose. The app is the
router's (`make_http_app`) served by the router's runner, with a flow no request here
reaches (`/tokenize` and `/health` need none).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tandem.router.config import RouterConfig
from tandem.router.http_protocol_errors import OpenAIErrorsAppRunner
from tandem.router.http_server import make_http_app
from tandem.router.openai.body_checks import DECODED_CONTENT_CODINGS
from tandem.router.policy import SloConfig
from tandem.router.tokenization import PromptTokenizer

pytestmark = pytest.mark.timeout(60)

# Every network wait of a test is bounded by this.
WAIT_S = 10.0
BODY = b'{"prompt": "hi"}'


class NoFlow:
    """Stands in for `RequestFlow`: the routes used here never generate."""

    slo = SloConfig()


@dataclass
class Reply:
    """One HTTP response as it came over the socket."""

    status: int
    # Header names lower-cased.
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The OpenAI error object; checks the JSON content type and shape first."""
        assert self.headers["content-type"].startswith("application/json"), self
        answer = json.loads(self.body)
        assert set(answer) == {"error"}, answer
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
        return answer["error"]


@contextlib.asynccontextmanager
async def serving(model_dir: Path, api_key: str | None = None) -> AsyncIterator[int]:
    """The router's HTTP app on a loopback port (which it yields), as the router runs it."""
    config = RouterConfig(model_dir=str(model_dir), grpc_port=0, http_port=0, api_key=api_key)
    tokenizer = PromptTokenizer(str(model_dir))
    app = make_http_app(None, NoFlow(), tokenizer, config)
    runner = OpenAIErrorsAppRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
        tokenizer.close()


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    """The next response (a `100 Continue` too) from `reader`."""
    async with asyncio.timeout(WAIT_S):
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status_line, *lines = head.split("\r\n")[:-2]
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(status_line.split()[1])
        body = await reader.readexactly(int(headers.get("content-length", 0)))
    return Reply(status, headers, body)


async def exchange(port: int, request: bytes) -> Reply:
    """Sends the raw `request` on a new connection and reads the answer."""
    async with asyncio.timeout(WAIT_S):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await read_reply(reader)
    finally:
        writer.close()


def post(path: str, headers: str, body: bytes = BODY) -> bytes:
    """A raw POST; `headers`: its header lines after Host, each ending in CRLF."""
    return f"POST {path} HTTP/1.1\r\nHost: router\r\n{headers}\r\n".encode() + body


def answer(model_dir: Path, request: bytes, api_key: str | None = None) -> Reply:
    """The router's reply to one request sent on its own connection."""

    async def scenario() -> Reply:
        async with serving(model_dir, api_key) as port:
            return await exchange(port, request)

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    ("request_bytes", "words"),
    [
        (post("/tokenize", "Content-Length: abc\r\n"), ("malformed", "content-length")),
        (post("/tokenize", "Content-Length: -5\r\n"), ("malformed", "content-length")),
        (
            post("/tokenize", f"X-Padding: {'a' * 9000}\r\nContent-Length: {len(BODY)}\r\n"),
            ("header line", "8190 bytes"),
        ),
    ],
    ids=["content-length-abc", "content-length-negative", "header-line-9000-bytes"],
)
def test_a_request_the_parser_refuses_gets_openai_json_and_one_log_line(
    tiny_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
    request_bytes: bytes,
    words: tuple[str, ...],
):
    """aiohttp answered these itself, in plain text, and logged each as an ERROR with a
    traceback (any client could fill the log)."""

    async def scenario() -> tuple[Reply, list[logging.LogRecord]]:
        async with serving(tiny_model_dir) as port:
            caplog.clear()
            reply = await exchange(port, request_bytes)
            return reply, list(caplog.records)

    with caplog.at_level(logging.DEBUG):
        reply, records = asyncio.run(scenario())
    assert reply.status == 400, reply
    error = reply.error()
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "malformed_request"
    for word in words:
        assert word in error["message"].lower(), error
    # The access log has its own line for every request.
    logged = [r for r in records if r.name != "aiohttp.access" and r.levelno >= logging.INFO]
    assert len(logged) <= 1, [r.getMessage() for r in logged]
    assert all(r.levelno < logging.ERROR and r.exc_info is None for r in logged), logged


def test_a_good_request_after_a_malformed_one_is_served(tiny_model_dir: Path):
    """The runner's protocol serves ordinary requests as aiohttp's does."""

    async def scenario() -> tuple[Reply, Reply]:
        async with serving(tiny_model_dir) as port:
            bad = await exchange(port, post("/tokenize", "Content-Length: abc\r\n"))
            good = await exchange(port, post("/tokenize", f"Content-Length: {len(BODY)}\r\n"))
            return bad, good

    bad, good = asyncio.run(scenario())
    assert bad.status == 400, bad
    assert good.status == 200, good
    assert json.loads(good.body)["count"] > 0


# --- Expect: router/openai/body_checks.check_expect -----------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        post("/tokenize", f"Expect: 200-ok\r\nContent-Length: {len(BODY)}\r\n"),
        b"GET /health HTTP/1.1\r\nHost: router\r\nExpect: 200-ok\r\n\r\n",
    ],
    ids=["post", "get"],
)
def test_an_unknown_expectation_is_a_417_in_json(tiny_model_dir: Path, request_bytes: bytes):
    """aiohttp's default expect handler, which runs before the middlewares, answered it
    in plain text."""

    reply = answer(tiny_model_dir, request_bytes)
    assert reply.status == 417, reply
    error = reply.error()
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "expectation_failed"
    assert "200-ok" in error["message"] and "100-continue" in error["message"], error


def test_expect_continue_over_the_body_limit_is_a_413_without_100_continue(
    tiny_model_dir: Path,
):
    """aiohttp's default answered `100 Continue` first: the client was invited to send
    the body it was then refused for."""
    limit = RouterConfig(model_dir=str(tiny_model_dir)).max_body_bytes
    head = post("/tokenize", f"Expect: 100-continue\r\nContent-Length: {limit + 1}\r\n", b"")

    reply = answer(tiny_model_dir, head)
    assert reply.status == 413, reply  # the first answer, not a 100
    error = reply.error()
    assert error["code"] == "request_too_large" and str(limit) in error["message"], error
    assert reply.headers["connection"] == "close"  # the body never read ends the connection


def invited_then_answered(
    model_dir: Path, head: bytes, api_key: str | None = None
) -> tuple[Reply, Reply]:
    """The reply to a request head that expects 100-continue, then the reply to its body
    sent after it."""

    async def scenario() -> tuple[Reply, Reply]:
        async with serving(model_dir, api_key) as port:
            async with asyncio.timeout(WAIT_S):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(head)
                invited = await read_reply(reader)
                writer.write(BODY)
                return invited, await read_reply(reader)
            finally:
                writer.close()

    return asyncio.run(scenario())


def test_expect_continue_within_the_body_limit_gets_100_then_the_answer(tiny_model_dir: Path):
    head = post("/tokenize", f"Expect: 100-continue\r\nContent-Length: {len(BODY)}\r\n", b"")

    invited, answer = invited_then_answered(tiny_model_dir, head)
    assert invited.status == 100, invited
    assert answer.status == 200, answer
    assert json.loads(answer.body)["count"] > 0


@pytest.mark.parametrize("authorization", ["", "Authorization: Bearer wrong\r\n"])
def test_expect_continue_without_the_api_key_is_a_401_without_100_continue(
    tiny_model_dir: Path, authorization: str
):
    """aiohttp runs the expect handler before the auth middleware: a client without the
    key was answered `100 Continue`, sent its body, and only then got its 401."""
    head = post(
        "/tokenize", f"{authorization}Expect: 100-continue\r\nContent-Length: {len(BODY)}\r\n", b""
    )

    reply = answer(tiny_model_dir, head, api_key="sesame")
    assert reply.status == 401, reply  # the first answer, not a 100
    assert reply.error()["code"] == "invalid_api_key"
    assert reply.headers["connection"] == "close"


def test_expect_continue_with_the_api_key_gets_100_then_the_answer(tiny_model_dir: Path):
    key = "Authorization: Bearer sesame\r\n"
    head = post("/tokenize", f"{key}Expect: 100-continue\r\nContent-Length: {len(BODY)}\r\n", b"")

    invited, answer = invited_then_answered(tiny_model_dir, head, api_key="sesame")
    assert invited.status == 100, invited
    assert answer.status == 200, answer


# --- Content-Encoding: router/openai/body_checks.content_encoding_middleware ----------


@pytest.mark.parametrize("encoding", ["foo", "x-gzip", "gzip, br"])
def test_a_body_in_a_coding_aiohttp_does_not_decode_is_a_415(tiny_model_dir: Path, encoding: str):
    """aiohttp read such a body as it came: a JSON body with `Content-Encoding: foo` was
    answered 200."""
    request_bytes = post(
        "/tokenize", f"Content-Encoding: {encoding}\r\nContent-Length: {len(BODY)}\r\n"
    )

    reply = answer(tiny_model_dir, request_bytes)
    assert reply.status == 415, reply
    error = reply.error()
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "unsupported_content_encoding"
    assert "unsupported content encoding" in error["message"], error
    assert json.dumps(encoding) in error["message"], error
    assert reply.headers["accept-encoding"] == ", ".join(DECODED_CONTENT_CODINGS)


def test_a_body_in_a_coding_aiohttp_decodes_is_read(tiny_model_dir: Path):
    """Identity, and each coding the middleware lets through, in any case: read as the
    plain body (fails if an aiohttp upgrade stops decoding one of them)."""
    import brotli

    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python >= 3.14
    except ImportError:
        from backports import zstd

    encoders = {"identity": lambda body: body, "IDENTITY": lambda body: body,
                "gzip": gzip.compress, "GZip": gzip.compress, "deflate": zlib.compress,
                "br": brotli.compress, "zstd": zstd.compress}  # fmt: skip
    assert set(DECODED_CONTENT_CODINGS) <= set(encoders)

    async def scenario() -> tuple[Reply, dict[str, Reply]]:
        async with serving(tiny_model_dir) as port:
            plain = await exchange(port, post("/tokenize", f"Content-Length: {len(BODY)}\r\n"))
            encoded = {}
            for name, encode in encoders.items():
                body = encode(BODY)
                head = f"Content-Encoding: {name}\r\nContent-Length: {len(body)}\r\n"
                encoded[name] = await exchange(port, post("/tokenize", head, body))
            return plain, encoded

    plain, encoded = asyncio.run(scenario())
    assert plain.status == 200, plain
    for name, reply in encoded.items():
        assert (reply.status, reply.body) == (200, plain.body), (name, reply)

"""Checks on an HTTP request's body made before a byte of it is read.

`check_expect` is the `expect_handler` of every route the router adds. aiohttp's
default answered `Expect: 100-continue` with `100 Continue` at once, so a client was
invited to send a body over the size limit and only then refused (413); and it answered
any other expectation with a plain-text 417. aiohttp runs a route's expect handler before
the app's middlewares, so its answers here are OpenAI error responses already, and it
checks the API key itself (the auth middleware's check, `openai/auth.py`): a client
without the key got `100 Continue` and sent its body before its 401.

`content_encoding_middleware`: aiohttp decodes a body in the codings of
DECODED_CONTENT_CODINGS and reads one in any other coding as it came, so a body sent
with `Content-Encoding: foo` was parsed as plain JSON and answered 200. It is a 415.
"""

from __future__ import annotations

from aiohttp import HttpVersion11, hdrs, web
from aiohttp.typedefs import Handler

from tandem.router.json_fields import show
from tandem.router.openai.auth import API_KEY, refusal
from tandem.router.openai.errors import MAX_BODY_BYTES, HttpApiError, body_too_large, error_response

# What aiohttp 3.14's request parser decodes (http_parser.py, _http_parser.pyx: one
# coding, any case; br and zstd with their packages installed).
DECODED_CONTENT_CODINGS = ("gzip", "deflate", "br", "zstd")


async def check_expect(request: web.Request) -> web.StreamResponse | None:
    """`100 Continue` for a body the router may read; otherwise the final answer (401 for
    a request without the API key the app wants, 417 for an expectation other than
    100-continue, 413 for a declared length over the limit). It runs before the
    middlewares, so it checks the key itself: a client without it is not invited to send
    a body it is then refused for."""
    if request.version != HttpVersion11:  # HTTP/1.0 has no Expect; aiohttp ignores it too
        return None
    api_key = request.app.get(API_KEY)
    if api_key is not None and (refused := refusal(request, api_key)) is not None:
        return _answer_unread(refused)
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        message = f"unsupported Expect: {show(expect)}; only 100-continue is supported"
        return error_response(HttpApiError(417, message, code="expectation_failed"))
    limit = request.app[MAX_BODY_BYTES]
    if request.content_length is not None and request.content_length > limit:
        return _answer_unread(body_too_large(limit))
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # as aiohttp's own: the response proper starts later
    return None


def _answer_unread(exc: HttpApiError) -> web.Response:
    """The error answer to a request whose body is never read: the connection cannot
    carry a next request after it, so it closes."""
    response = error_response(exc)
    response.force_close()
    return response


@web.middleware
async def content_encoding_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """415 for a body in a content coding aiohttp does not decode (`identity`: none)."""
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity")
    if not request.body_exists or encoding.lower() in ("identity", *DECODED_CONTENT_CODINGS):
        return await handler(request)
    accepted = ", ".join(DECODED_CONTENT_CODINGS)
    message = (
        f"unsupported content encoding {show(encoding)}; send the body uncompressed or in "
        f"one of {accepted}"
    )
    response = error_response(HttpApiError(415, message, code="unsupported_content_encoding"))
    response.headers[hdrs.ACCEPT_ENCODING] = accepted  # as RFC 9110 asks of a 415
    return response

"""OpenAI error JSON for the HTTP requests aiohttp refuses before the app sees them.

aiohttp's HTTP parser refuses a malformed request head (`Content-Length: abc`, a header
line over 8,190 bytes, ...) itself: it answers through `RequestHandler.handle_error`,
outside the app and its middlewares, in plain text, and logs each one as an ERROR with
its traceback, so any client could fill the log. aiohttp has no option for either:
`web.Server` builds a `RequestHandler` per connection, with no setting for its class or
error answer. So, written against aiohttp 3.14.5: a `RequestHandler` whose
`handle_error` answers OpenAI error JSON and logs one line without a traceback for the
client's errors, made by a `web.Server` subclass, which `OpenAIErrorsAppRunner` (the
router's `web.AppRunner`) serves. tests/router/test_http_edge.py sends such requests
over a socket: it fails if a new aiohttp stops calling `handle_error` for them.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from tandem.router.openai.errors import HttpApiError, error_response

logger = logging.getLogger(__name__)


def malformed_request_error(
    status: int, exc: BaseException | None, message: str | None
) -> HttpApiError:
    """The client's error as the parser saw it; aiohttp's message, up to its first line
    (the rest points a caret at the bad byte, which JSON shows badly)."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1]
        text = f"a header line or the request line is longer than {limit} bytes"
    else:
        reason = (message or "").split("\n", 1)[0].strip().rstrip(":")
        text = f"the HTTP request is malformed: {reason or 'it cannot be parsed'}"
    return HttpApiError(status, text, code="malformed_request")


class OpenAIErrorsRequestHandler(RequestHandler):
    """aiohttp's HTTP/1 protocol, answering its own errors as OpenAI error JSON."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Called for a request the parser refused (400) and for an exception that
        escaped the app (500: a bug, logged with its traceback as aiohttp does)."""
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            error = HttpApiError(status, "internal server error; see the router log",
                                 "internal_error")  # fmt: skip
        else:
            error = malformed_request_error(status, exc, message)
            # Non-HTTP traffic (TLS to this port, scanners) is noise: aiohttp's own choice.
            level = logging.DEBUG if isinstance(exc, BadHttpMethod) else logging.INFO
            logger.log(level, "HTTP %d to %s: %s", status, request.remote, error)
        if request.writer.output_size > 0:  # as aiohttp: a response has begun already
            raise ConnectionError("a response is being sent; cannot send an error instead")
        response = error_response(error)
        response.force_close()  # the parser cannot go on after an error
        return response


class _OpenAIErrorsServer(web.Server):
    """`web.Server` with an `OpenAIErrorsRequestHandler` per connection."""

    def __call__(self) -> RequestHandler:
        return OpenAIErrorsRequestHandler(self, loop=self._loop, **self._kwargs)


class OpenAIErrorsAppRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer aiohttp's own errors as OpenAI JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # starts the app; its handler and factory
        return _OpenAIErrorsServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            **server._kwargs,
        )

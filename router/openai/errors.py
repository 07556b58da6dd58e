"""OpenAI error JSON at the HTTP boundary, and the middleware that produces it.

Every failure on the HTTP side leaves as `{"error": {"message", "type", "param", "code"}}`
with a matching status: the router's own `RouterError`s (400 / 404 / 429 / 503 / 504),
the HTTP layer's errors (401, 404 route, 405, 413, 400 for a body that cannot be read)
and, as a last resort, 500 for a bug (logged with its traceback here, never shown to the
client).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from tandem.router.errors import InvalidRequest, ModelNotFound, RouterError, retry_after_header

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The app's body size limit (`client_max_size`), for the 413 message.
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)


class HttpApiError(RouterError):
    """An error of the HTTP layer itself (authentication, routing, body size)."""

    def __init__(
        self,
        http_status: int,
        message: str,
        openai_type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.openai_type = openai_type
        self.code = code


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus requested output do not fit in the model's context."""

    code = "context_length_exceeded"


def error_code(exc: RouterError) -> str | None:
    """OpenAI's machine-readable `code` for an error, where it has one."""
    code = getattr(exc, "code", None)
    if code is not None:
        return code
    if isinstance(exc, ModelNotFound):
        return "model_not_found"
    return None


def error_body(exc: RouterError) -> dict[str, Any]:
    return {
        "error": {
            "message": str(exc),
            "type": exc.openai_type,
            "param": getattr(exc, "param", None),
            "code": error_code(exc),
        }
    }


def dumps(obj: Any) -> str:
    """Compact JSON; non-finite floats are a bug here (they are not valid JSON)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _ascii_dumps(obj: Any) -> str:
    """`dumps` with every non-ASCII character escaped: an error message may quote the
    client's text, and this encodes whatever that holds (a lone surrogate too)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def error_response(exc: RouterError) -> web.Response:
    headers = {}
    retry_after = retry_after_header(exc)
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return web.json_response(
        error_body(exc), status=exc.http_status, headers=headers, dumps=_ascii_dumps
    )


def body_too_large(limit: int) -> HttpApiError:
    return HttpApiError(
        413, f"request body is too large: the limit is {limit} bytes", code="request_too_large"
    )


def from_http_exception(exc: web.HTTPException, request: web.Request) -> HttpApiError:
    """The OpenAI-shaped equivalent of an aiohttp HTTP error (404 route, 405, 413 ...)."""
    status = exc.status
    if status == 404:
        message = f"no route for {request.method} {request.path}"
        return HttpApiError(404, message, code="not_found")
    if status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ())) or "none"
        message = f"method {request.method} is not allowed on {request.path} (allowed: {allowed})"
        return HttpApiError(405, message, code="method_not_allowed")
    if status == 413:
        return body_too_large(request.app[MAX_BODY_BYTES])
    openai_type = "server_error" if status >= 500 else "invalid_request_error"
    return HttpApiError(status, exc.text or exc.reason, openai_type)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns every exception a handler raises into an OpenAI error response."""
    try:
        return await handler(request)
    except RouterError as exc:
        if exc.http_status >= 500:
            logger.warning("%s %s failed: %s", request.method, request.path, exc)
        return error_response(exc)
    except RequestPayloadError as exc:
        # A body aiohttp cannot read (a broken gzip or deflate stream, a truncated chunk):
        # the client's fault. The reason is the cause's message.
        reason = getattr(exc.__cause__, "message", None) or str(exc)
        return error_response(InvalidRequest(f"the request body cannot be read: {reason}"))
    except web.HTTPException as exc:
        if exc.status < 400:  # redirects and the like pass through unchanged
            raise
        response = error_response(from_http_exception(exc, request))
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception:
        logger.exception("%s %s: unexpected error", request.method, request.path)
        error = HttpApiError(500, "internal server error; see the router log", "internal_error")
        return error_response(error)

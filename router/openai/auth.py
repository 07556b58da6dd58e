"""Optional API key check for the HTTP API (`Authorization: Bearer <key>`).

Probes (`/health`, `/metrics`) stay open so load balancers and Prometheus need no key.
"""

from __future__ import annotations

from aiohttp import web

from tandem.router.api_key import bearer_matches
from tandem.router.openai.errors import Handler, HttpApiError

OPEN_PATHS = frozenset({"/health", "/metrics"})


# The key the app wants (set only when it wants one): read by `auth_middleware` and by
# `check_expect`, which runs before the middlewares.
API_KEY = web.AppKey("api_key", bytes)


def refusal(request: web.Request, expected: bytes) -> HttpApiError | None:
    """The 401 for a request to a path that needs the key and lacks it; None if it may
    pass."""
    if request.path in OPEN_PATHS:
        return None
    header = request.headers.get("Authorization", "")
    if not header:
        return HttpApiError(
            401,
            "missing API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
    if not bearer_matches(header, expected):
        return HttpApiError(
            401,
            "incorrect API key in the Authorization header (expected 'Bearer <key>')",
            code="invalid_api_key",
        )
    return None


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuses a request without the app's API key (`API_KEY`); passes every request of
    an app without one."""
    expected = request.app.get(API_KEY)
    if expected is not None and (refused := refusal(request, expected)) is not None:
        raise refused
    return await handler(request)

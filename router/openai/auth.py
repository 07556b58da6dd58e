"""Optional API key check for the HTTP API (`Authorization: Bearer <key>`).

Probes (`/health`, `/metrics`) stay open so load balancers and Prometheus need no key.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Middleware

from tandem.router.api_key import bearer_matches
from tandem.router.openai.errors import Handler, HttpApiError

OPEN_PATHS = frozenset({"/health", "/metrics"})


def make_auth_middleware(api_key: str) -> Middleware:
    expected = api_key.encode()

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        if not header:
            raise HttpApiError(
                401,
                "missing API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if not bearer_matches(header, expected):
            raise HttpApiError(
                401,
                "incorrect API key in the Authorization header (expected 'Bearer <key>')",
                code="invalid_api_key",
            )
        return await handler(request)

    return auth_middleware

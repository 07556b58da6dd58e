"""Optional API key check for the HTTP API (`Authorization: Bearer <key>`).

Probes (`/health`, `/metrics`) stay open so load balancers and Prometheus need no key.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Middleware

from tandem.router.openai.errors import Handler, HttpApiError

OPEN_PATHS = frozenset({"/health", "/metrics"})


def make_auth_middleware(api_key: str) -> Middleware:
    expected = api_key.encode()

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise HttpApiError(
                401,
                "missing API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise HttpApiError(
                401,
                "incorrect API key in the Authorization header (expected 'Bearer <key>')",
                code="invalid_api_key",
            )
        return await handler(request)

    return auth_middleware

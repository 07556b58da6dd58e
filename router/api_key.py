"""The router's API key (`--api-key`): who may call its public APIs.

With a key, every call must carry it as a bearer token: HTTP `Authorization: Bearer
<key>` (`router/openai/auth.py`), gRPC metadata `authorization: Bearer <key>` on every
service of the public port (`tandem.v1.Generation`, KServe's
`inference.GRPCInferenceService`, `tandem.admin.v1.Admin`), checked once here, by a
server interceptor, before a request is parsed. Health (`grpc.health.v1.Health`, KServe's
`ServerLive` / `ServerReady` / `ModelReady`, HTTP `/health`) and gRPC server reflection
stay open: probes and tools need no secret, and they reveal only whether the server is
up and ready, and the published .proto schemas.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Any

from tandem.proto.cluster_auth import RefusalLog, RefusingInterceptor, metadata_value

# gRPC methods any caller may use without the key: health probes (gRPC's, and KServe's
# liveness and readiness, which probes of Triton-style servers use) and reflection.
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/inference.GRPCInferenceService/ModelReady",
)
GRPC_REFUSAL = "missing or incorrect API key: send metadata 'authorization: Bearer <key>'"


def bearer_matches(header: str | None, expected: bytes) -> bool:
    """Whether an Authorization header (HTTP) or metadata value (gRPC) is `Bearer
    <expected>` (scheme case-insensitive; compared in constant time)."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected)


class ApiKeyInterceptor(RefusingInterceptor):
    """Refuses every call but health, KServe's probes and reflection unless its
    metadata carries the key; refusals are logged with the method and peer only, at
    most once per interval."""

    def __init__(self, api_key: str) -> None:
        super().__init__(RefusalLog("public gRPC call"), OPEN_METHOD_PREFIXES)
        self._expected = api_key.encode()

    def why_refused(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        header = metadata_value(metadata, "authorization")
        if bearer_matches(header, self._expected):
            return None
        return "no API key" if header is None else "wrong API key"

    def refusal_message(self, reason: str) -> str:
        return GRPC_REFUSAL

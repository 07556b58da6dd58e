"""Who may talk to a worker: the cluster token on internal gRPC, optional mutual TLS.

Workers' gRPC servers (`PrefillWorker`, `DecodeWorker`, `KvTransfer`) refuse a call
that does not carry the cluster token in its metadata (UNAUTHENTICATED), and the
prefill side's TCP KV data server refuses a connection whose `Hello` does not prove
the token (`kv_hello_proof`). `grpc.health.v1.Health` stays open, so probes (Ray,
Kubernetes, a load balancer) need no secret; it reveals only SERVING / NOT_SERVING.
Every internal client (router -> workers, decode -> prefill) opens its channels with
`internal_channel`, which adds the token to every call.

With `InternalTls`, internal gRPC also runs over mutual TLS: every server and client
presents the cluster certificate and checks the peer's against the cluster CA. The
TCP KV data plane stays plain TCP (its handshake never sends the token itself).

A refusal is logged with the method (or "KV data") and the peer address only, never
a request, and at most once per `REFUSAL_LOG_INTERVAL_S` (with a count), so a
scanner cannot flood the log.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tandem.proto.malformed_requests import MalformedRequestInterceptor
from tandem.proto.method_handlers import method_handler
from tandem.proto.server_options import GRPC_OPTIONS, SERVER_OPTIONS

logger = logging.getLogger(__name__)

# gRPC metadata key of the token (lower case, as gRPC requires).
TOKEN_METADATA_KEY = "x-tandem-cluster-token"
TOKEN_ENV = "TANDEM_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "TANDEM_CLUSTER_TOKEN_FILE"
# Short tokens are guessable; `generate_token` makes 43 characters.
MIN_TOKEN_LEN = 16
# Methods any caller may use: health probes.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
REFUSAL_LOG_INTERVAL_S = 10.0


def generate_token() -> str:
    """A fresh random cluster token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in a file (surrounding whitespace ignored); ValueError when empty."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"cluster token file {path} is empty")
    return token


def token_from_environment(
    token_file: str | None, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The configured token: `token_file`, else $TANDEM_CLUSTER_TOKEN, else the file
    named by $TANDEM_CLUSTER_TOKEN_FILE; None when none is set."""
    if token_file:
        return read_token_file(token_file)
    if environ.get(TOKEN_ENV):
        return environ[TOKEN_ENV].strip()
    if environ.get(TOKEN_FILE_ENV):
        return read_token_file(environ[TOKEN_FILE_ENV])
    return None


@dataclass(frozen=True)
class InternalTls:
    """Mutual TLS for internal gRPC: PEM files present on every node of the cluster."""

    # This process's certificate chain and private key (servers and clients alike).
    cert_file: str
    key_file: str
    # The CA that signed every internal certificate; peers are checked against it.
    ca_file: str
    # Name clients check in the server's certificate instead of the host they dial
    # ("" = the host): one certificate can then serve workers on any address.
    server_name: str = ""

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if not path or not Path(path).is_file():
                raise ValueError(f"internal TLS {name} {path!r} is not a file")

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return (
            Path(self.cert_file).read_bytes(),
            Path(self.key_file).read_bytes(),
            Path(self.ca_file).read_bytes(),
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )


@dataclass(frozen=True)
class ClusterAuth:
    """How internal connections authenticate; the default (no token) leaves them open.

    Built once (`tandem serve` generates a token for the cluster it starts) and handed
    to every worker and router through their configs.
    """

    # Shared secret of the cluster; None = internal services accept anyone (in-process
    # tests, benchmarks). Never printed (repr=False).
    token: str | None = field(default=None, repr=False)
    tls: InternalTls | None = None

    def __post_init__(self) -> None:
        if self.token is not None:
            if not isinstance(self.token, str) or len(self.token) < MIN_TOKEN_LEN:
                raise ValueError(
                    f"cluster token must be a string of at least {MIN_TOKEN_LEN} characters"
                )
            if not self.token.isascii() or not self.token.isprintable():
                raise ValueError("cluster token must be printable ASCII (it travels as metadata)")

    @property
    def requires_token(self) -> bool:
        return self.token is not None

    def accepts(self, presented: str | None) -> bool:
        """Whether `presented` is the token (constant time); always True when open."""
        if self.token is None:
            return True
        return presented is not None and hmac.compare_digest(presented, self.token)

    def kv_hello_proof(self, channel_id: str) -> str:
        """What a KV data connection's `Hello` carries: an HMAC of its channel id, so the
        token itself never crosses the (plain TCP) data plane; "" when open."""
        if self.token is None:
            return ""
        mac = hmac.new(self.token.encode(), f"tandem-kv-hello:{channel_id}".encode(), "sha256")
        return mac.hexdigest()

    def accepts_kv_hello(self, channel_id: str, proof: str) -> bool:
        if self.token is None:
            return True
        return hmac.compare_digest(proof.encode(), self.kv_hello_proof(channel_id).encode())

    def fingerprint(self) -> str:
        """A short, non-secret id of the token (for logs): which token, not what it is."""
        if self.token is None:
            return "open"
        return hashlib.sha256(f"tandem-fingerprint:{self.token}".encode()).hexdigest()[:8]


class RefusalLog:
    """Logs refused connections without prompt data, at most once per interval, and
    tells `on_refused` (a metric) of every one (from any thread)."""

    def __init__(
        self,
        what: str,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        self.what = what
        self.interval_s = interval_s
        self.on_refused = on_refused
        self.num_refused = 0
        self._lock = threading.Lock()
        self._last_logged = -float("inf")
        self._suppressed = 0

    def refused(self, target: str, peer: str, reason: str) -> None:
        if self.on_refused is not None:
            self.on_refused()
        with self._lock:
            self.num_refused += 1
            now = time.monotonic()
            if now - self._last_logged < self.interval_s:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
            self._last_logged = now
        more = f" ({suppressed} more refused since the last report)" if suppressed else ""
        logger.warning("refused %s %s from %s: %s%s", self.what, target, peer, reason, more)


class RefusingInterceptor(grpc.aio.ServerInterceptor):
    """Turns away, UNAUTHENTICATED, every call but those of `open_methods` (method name
    prefixes) that `why_refused` finds a reason to, before its request is read (nor
    logged); each refusal goes to `log`."""

    def __init__(self, log: RefusalLog, open_methods: tuple[str, ...]) -> None:
        self.log = log
        self.open_methods = open_methods

    def why_refused(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """Why a call with this metadata may not go on; None when it may."""
        raise NotImplementedError

    def refusal_message(self, reason: str) -> str:
        """What the client is told."""
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        reason = None
        if not method.startswith(self.open_methods):
            reason = self.why_refused(handler_call_details.invocation_metadata)
        if reason is None:
            return await continuation(handler_call_details)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            self.log.refused(method, context.peer(), reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self.refusal_message(reason))

        return _refusal_handler(await continuation(handler_call_details), refuse)


class ClusterTokenInterceptor(RefusingInterceptor):
    """Refuses every call but health probes unless its metadata carries the cluster
    token."""

    def __init__(self, auth: ClusterAuth, on_refused: Callable[[], None] | None = None) -> None:
        super().__init__(RefusalLog("internal call", on_refused=on_refused), OPEN_METHOD_PREFIXES)
        self.auth = auth

    def why_refused(self, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        presented = metadata_value(metadata, TOKEN_METADATA_KEY)
        if self.auth.accepts(presented):
            return None
        return "no cluster token" if presented is None else "wrong cluster token"

    def refusal_message(self, reason: str) -> str:
        return f"{reason}: internal calls need the cluster token"


def metadata_value(metadata: Sequence[tuple[str, Any]] | None, key: str) -> str | None:
    """The first text value of `key` in a call's metadata (None when absent)."""
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else None
    return None


def _refusal_handler(
    handler: grpc.RpcMethodHandler | None,
    refuse: Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]],
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (one message or a stream, in and out)
    that runs `refuse` (which aborts) instead: raw bytes in, so the request is not even
    parsed."""
    if handler is None:
        return method_handler(refuse, False, False)
    return method_handler(refuse, handler.request_streaming, handler.response_streaming)


class _AddedMetadata:
    """Adds one metadata entry (the cluster token, an API key) to every call."""

    def __init__(self, key: str, value: str) -> None:
        self._key, self._value = key, value

    def _with_entry(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata[self._key] = self._value
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready,
        )  # fmt: skip


# grpc.aio files each interceptor under the first call kind it implements, so each
# kind needs an object of its own.
class _UnaryUnaryMetadata(_AddedMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._with_entry(client_call_details), request)


class _UnaryStreamMetadata(_AddedMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._with_entry(client_call_details), request)


class _StreamUnaryMetadata(_AddedMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Any,
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(self._with_entry(client_call_details), request_iterator)


class _StreamStreamMetadata(_AddedMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Any,
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(self._with_entry(client_call_details), request_iterator)


def metadata_interceptors(key: str, value: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that add `key: value` to the metadata of every call of a
    grpc.aio channel (all four call kinds)."""
    kinds = (_UnaryUnaryMetadata, _UnaryStreamMetadata, _StreamUnaryMetadata, _StreamStreamMetadata)
    return [kind(key, value) for kind in kinds]


def _token_interceptors(auth: ClusterAuth) -> list[grpc.aio.ClientInterceptor] | None:
    if auth.token is None:
        return None
    return metadata_interceptors(TOKEN_METADATA_KEY, auth.token)


def internal_channel(
    endpoint: str, auth: ClusterAuth, options: Sequence[tuple[str, Any]] = GRPC_OPTIONS
) -> grpc.aio.Channel:
    """A channel to a worker that carries the cluster token (and TLS when set).

    Create it on the event loop that will use it: with a token, grpc.aio runs the
    token interceptors as tasks of the loop current at creation."""
    interceptors = _token_interceptors(auth)
    if auth.tls is None:
        return grpc.aio.insecure_channel(endpoint, options=options, interceptors=interceptors)
    options = list(options)
    if auth.tls.server_name:
        options.append(("grpc.ssl_target_name_override", auth.tls.server_name))
    return grpc.aio.secure_channel(
        endpoint, auth.tls.channel_credentials(), options=options, interceptors=interceptors
    )


def internal_server(
    auth: ClusterAuth,
    options: Sequence[tuple[str, Any]] = SERVER_OPTIONS,
    on_refused: Callable[[], None] | None = None,
) -> grpc.aio.Server:
    """A worker's gRPC server: checks the token on every call but health probes
    (`on_refused` is called for each call it refuses), then that the request parses."""
    interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
    if auth.requires_token:
        interceptors.insert(0, ClusterTokenInterceptor(auth, on_refused))
    return grpc.aio.server(options=options, interceptors=interceptors)


def add_internal_port(server: grpc.aio.Server, address: str, auth: ClusterAuth) -> int:
    """Bind `address` (TLS when set); the port bound."""
    if auth.tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, auth.tls.server_credentials())

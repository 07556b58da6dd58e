"""Ports a server listens on that another process holds: one clear error, early.

`tandem serve` checks its public ports before it starts Ray and its workers (tens of
seconds, then a traceback from the router's bind); the router names the port when its
own bind fails (another process took it meanwhile)."""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass


class PortInUse(OSError):
    """A port a server was to listen on is held by another process (or not bindable)."""


@dataclass(frozen=True)
class Listen:
    """What listens (for the message), the flag that moves it, where."""

    what: str
    flag: str
    host: str
    port: int

    def in_use(self, reason: str) -> PortInUse:
        return PortInUse(
            f"{self.what} port {self.port} on {self.host} is not free ({reason}); "
            f"stop what holds it or choose another with {self.flag}"
        )


def public_listens(host: str, grpc_port: int, http_port: int) -> tuple[Listen, Listen]:
    """A router's public gRPC and HTTP ports, as `tandem serve` and `tandem router` name
    their flags."""
    return (Listen("gRPC", "--grpc-port", host, grpc_port),
            Listen("HTTP", "--http-port", host, http_port))  # fmt: skip


def check_free(listens: Iterable[Listen]) -> None:
    """PortInUse for the first port that cannot be bound now (port 0 is skipped: the
    system picks a free one). Bound as the servers bind (address reuse on, so a port
    whose last connections linger in TIME_WAIT counts as free) and closed at once."""
    for listen in listens:
        if listen.port == 0:
            continue
        try:
            infos = socket.getaddrinfo(listen.host, listen.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise listen.in_use(f"host not resolved: {exc.strerror}") from None
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise listen.in_use(exc.strerror or str(exc)) from None

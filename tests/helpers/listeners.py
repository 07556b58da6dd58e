"""The TCP sockets this test process and every process it started listen on, for
asserting that a local cluster serves on loopback only."""

from __future__ import annotations

import ipaddress

import psutil


def listening_addresses() -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket owned by this
    process or one it started, directly or not (Ray's GCS, raylet, agents, workers)."""
    own = psutil.Process()
    processes = {p.pid: p for p in [own, *own.children(recursive=True)]}
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in processes:
            continue
        try:
            name = processes[conn.pid].name()
        except psutil.NoSuchProcess:
            continue
        found.append((name, conn.laddr.ip, conn.laddr.port))
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.0/8 and ::1, also in IPv4-mapped form ("::ffff:127.0.0.1")."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def non_loopback_listeners() -> list[tuple[str, str, int]]:
    return [entry for entry in listening_addresses() if not is_loopback(entry[1])]

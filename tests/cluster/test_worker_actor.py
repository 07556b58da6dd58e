"""Which address a worker binds and advertises on a Ray node."""

from __future__ import annotations

import pytest

from tandem.cluster.worker_actor import node_host


@pytest.mark.parametrize(
    ("configured", "node_ip", "expected"),
    [
        ("127.0.0.1", "10.0.3.7", "10.0.3.7"),  # loopback on a reachable node: the node's
        ("127.0.0.1", "127.0.0.1", "127.0.0.1"),  # all on loopback: stay there
        ("0.0.0.0", "10.0.3.7", "0.0.0.0"),  # the operator's choice stands
        ("192.168.1.5", "10.0.3.7", "192.168.1.5"),
        ("worker.local", "10.0.3.7", "worker.local"),
        ("::1", "fd00::7", "fd00::7"),
    ],
)
def test_node_host(configured, node_ip, expected):
    assert node_host(configured, node_ip) == expected

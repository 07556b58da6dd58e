"""A decode worker's channels to prefill workers for KV releases: one to a prefill
worker that is gone is closed and dropped (prefill workers come and go, on new ports)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tandem.bench.harness import free_port
from tandem.decode_worker.service import DecodeService
from tandem.kv_transfer import KvHandle
from tandem.proto.cluster_auth import ClusterAuth

pytestmark = pytest.mark.timeout(60)


def test_a_release_to_a_gone_prefill_worker_drops_its_channel():
    config = SimpleNamespace(cluster_auth=ClusterAuth())
    service = DecodeService(config, None, None, None, None)  # type: ignore[arg-type]
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens: the worker is gone

    async def scenario() -> None:
        handle = KvHandle(worker_id="prefill-9", endpoint=endpoint, request_id="r")
        await service._release(handle)
        assert endpoint not in service._peers
        await service.close()

    asyncio.run(scenario())

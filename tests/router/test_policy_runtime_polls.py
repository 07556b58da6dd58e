"""A Stats poll that finds a worker gone: a warning for a worker that should be serving,
INFO for one the membership took off placement (draining), which stops answering as it
leaves in every orderly scale-down (operators alerting on warnings were paged for it)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.router.config import RouterConfig
from tandem.router.policy_runtime import PolicyRuntime
from tandem.router.worker_pool import WorkerEndpoint, WorkerPool

pytestmark = pytest.mark.timeout(60)


def test_a_draining_worker_that_stops_answering_is_no_warning(tiny_model_dir, caplog):
    async def scenario() -> None:
        # Nothing listens at port 1: both polls fail UNAVAILABLE.
        pool = WorkerPool([WorkerEndpoint(f"decode-{i}", "decode", "127.0.0.1:1") for i in (0, 1)])
        try:
            config = RouterConfig(model_dir=str(tiny_model_dir), probe_timeout_s=2.0)
            runtime = PolicyRuntime(config, pool)
            runtime.set_placeable("decode-0", False)  # the membership says: draining
            for worker in pool.workers:
                await runtime._poll_one(None, worker)  # type: ignore[arg-type]
        finally:
            await pool.close()

    caplog.set_level("INFO", logger="tandem.router.policy_runtime")
    asyncio.run(scenario())
    levels = {
        record.getMessage().split()[1]: record.levelname
        for record in caplog.records
        if "unreachable" in record.getMessage()
    }
    assert levels == {"decode-0": "INFO", "decode-1": "WARNING"}

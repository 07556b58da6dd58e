"""A stopping router gives the HTTP requests in flight its grace, then ends them.

aiohttp's shutdown waits its timeout for a handler, then cancels the request and waits
the timeout again for a handler that does not notice (a stream): a router with a long
stream took twice its grace to stop (32.8 s for a 20 s grace, past Kubernetes' default
30 s before SIGKILL). Here the grace is shortened to keep the test short.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

import tandem.router.server as router_server
from tests.helpers.inproc_cluster import InprocCluster

pytestmark = pytest.mark.timeout(120)

GRACE_S = 0.5


def test_a_stream_running_past_the_grace_is_ended_when_it_runs_out(
    tiny_model_dir, monkeypatch, caplog
):
    monkeypatch.setattr(router_server, "STOP_GRACE_S", GRACE_S)
    cluster = InprocCluster(str(tiny_model_dir)).start()
    body = {"model": cluster.router.config.model_name, "prompt": "the", "max_tokens": 1000,
            "ignore_eos": True, "temperature": 0, "stream": True, "n": 16}  # fmt: skip

    stopped = False
    data_lines: list[bytes] = []

    async def scenario() -> None:
        nonlocal stopped
        async with aiohttp.ClientSession() as session:
            url = f"{cluster.http_endpoint}/v1/completions"
            async with session.post(url, json=body) as response:
                assert response.status == 200
                stopping = None
                async for line in response.content:
                    if line.startswith(b"data: "):
                        data_lines.append(line.strip())
                    if len(data_lines) == 32 and stopping is None:  # stop the router under it
                        stopped = True
                        stopping = asyncio.create_task(cluster.router.stop())
                assert stopping is not None
                await stopping

    caplog.set_level(logging.WARNING, logger="tandem.router.server")
    try:
        cluster.run(scenario(), timeout_s=90)
    finally:
        if stopped:  # (a router stops once)
            cluster.router = None
        cluster.stop()
    # Ended by the router when its grace ran out (the 16 x 1000-token stream runs for
    # seconds); before, aiohttp waited twice the grace, then left it running.
    assert "1 HTTP requests still running after the 0.5 s grace; ending them" in caplog.text
    # The client is told: a retriable error event, then [DONE] (before, the stream just
    # stopped, and an OpenAI client took the cut text for a whole one).
    assert data_lines[-1] == b"data: [DONE]"
    error = json.loads(data_lines[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and "router stopped" in error["message"], error
    assert all(b'"error"' not in line for line in data_lines[:-2])

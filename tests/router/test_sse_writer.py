"""The SSE writer's bound on a client that takes nothing: it counts as gone, so its
stream ends and the request's worker calls with it; a client that reads, however
slowly, is not cut (streams against real clusters: test_openai_api.py,
test_migration.py; the count of bytes a real client has not taken:
test_client_backlog.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.router.openai import streaming
from tandem.router.openai.streaming import SseWriter

pytestmark = pytest.mark.timeout(60)


class StuckResponse:
    """A response whose client reads nothing: a write waits for ever (aiohttp's drain
    once the socket buffers are full); `accepting` lets the first writes through."""

    def __init__(self, accepting: int) -> None:
        self.accepting = accepting
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        if self.accepting == 0:
            await asyncio.Event().wait()
        self.accepting -= 1
        self.written.append(data)

    async def write_eof(self) -> None:
        await self.write(b"")


def test_a_client_that_takes_nothing_counts_as_gone(monkeypatch):
    monkeypatch.setattr(streaming, "WRITE_TIMEOUT_S", 0.3)
    response = StuckResponse(accepting=1)
    writer = SseWriter(response, unsent=lambda: 4096)  # type: ignore[arg-type]

    async def scenario() -> tuple[bool, bool, float]:
        first = await writer.write_quietly(b"data: 1\n\n")
        started = time.monotonic()
        second = await writer.write_quietly(b"data: 2\n\n")
        return first, second, time.monotonic() - started

    first, second, waited_s = asyncio.run(scenario())
    assert (first, second) == (True, False)
    assert 0.3 <= waited_s < 2.0
    assert response.written == [b"data: 1\n\n"]
    with pytest.raises(ConnectionResetError, match=r"took no data for 0\.3 s"):
        asyncio.run(writer.write(b"data: 3\n\n"))


class SlowClientResponse:
    """A response whose client takes `rate` bytes a second: a write waits until its
    bytes are taken (as aiohttp's drain does once the socket buffers are full)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.unsent = 0.0
        self.written: list[bytes] = []

    def left(self) -> int:
        return int(self.unsent)

    async def write(self, data: bytes) -> None:
        self.unsent += len(data)
        while self.unsent > 0:
            await asyncio.sleep(0.01)
            self.unsent -= self.rate * 0.01
        self.written.append(data)


def test_a_client_that_reads_slowly_is_not_cut(monkeypatch):
    monkeypatch.setattr(streaming, "WRITE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(streaming, "PROGRESS_CHECK_S", 0.05)
    response = SlowClientResponse(rate=1000)
    writer = SseWriter(response, unsent=response.left)  # type: ignore[arg-type]

    async def scenario() -> float:
        started = time.monotonic()
        await writer.write(b"x" * 1000)  # 1 s of the client's reading
        return time.monotonic() - started

    assert asyncio.run(scenario()) >= 0.9
    assert response.written == [b"x" * 1000]

"""The SSE writer's bound on a client that takes nothing: it counts as gone, so its
stream ends and the request's worker calls with it (streams against real clusters:
test_openai_api.py, test_migration.py)."""

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
    writer = SseWriter(response)  # type: ignore[arg-type]

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

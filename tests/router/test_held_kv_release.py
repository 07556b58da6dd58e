"""Who unpins a prompt's KV on the prefill worker when the decode side ends early.

The decode worker tells the prefill worker to unpin once it has pulled the KV. A decode
worker killed right after it answered may never have sent that, so the router unpins
on every failure of the decode stream (a no-op on the worker where nothing is held);
where the stream ends normally, or the client goes once tokens came, it leaves it to
the decode worker. The worker calls here are stand-ins recording what the flow asks
for: the decision is the flow's (router/sequence_flow.py `decode_held`).
"""

from __future__ import annotations

import asyncio
import contextlib
import types

import pytest

from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.attempts import AttemptFailed, MigrationReason
from tandem.router.errors import WorkerUnavailable
from tandem.router.sequence_flow import SequenceFlow
from tandem.telemetry.tracing import Tracing


class RecordingCalls:
    """The decode stream yields `num_chunks` chunks, then ends or fails as told."""

    def __init__(self, num_chunks: int, fails: bool, cancelled_meanwhile: bool = False) -> None:
        self.num_chunks, self.fails = num_chunks, fails
        self.cancelled_meanwhile = cancelled_meanwhile
        self.tracing = Tracing("test")
        self.released: list[str] = []

    async def decode(self, pair, request, seq, span, attempt):
        for i in range(self.num_chunks):
            yield f"chunk-{i}"
        if self.fails:
            raise AttemptFailed(
                "decode-0", MigrationReason.DECODE_FAILED, WorkerUnavailable("worker gone"), True
            )

    async def release(self, pair, held_id: str) -> None:
        self.released.append(held_id)
        if self.cancelled_meanwhile:  # the client leaves while the release runs
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            # As `WorkerCalls.release` does: the shielded call goes on, the cancel is
            # absorbed here.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(1.0)


def held_flow(calls: RecordingCalls):
    flow = SequenceFlow.__new__(SequenceFlow)  # only `calls` is read on this path
    flow.calls = calls  # type: ignore[assignment]
    seq = types.SimpleNamespace(span=None, index=0)
    pair = types.SimpleNamespace(decode=types.SimpleNamespace(worker_id="decode-0"))
    request = pb.DecodeRequest(request_id="r")
    request.kv_handle.request_id = "r"
    return flow.decode_held(pair, request, seq, attempt=None, first=None)  # type: ignore[arg-type]


async def drain(chunks, stop_after: int | None = None) -> list[str]:
    got = []
    async for chunk in chunks:
        got.append(chunk)
        if stop_after is not None and len(got) == stop_after:
            await chunks.aclose()
            break
    return got


@pytest.mark.parametrize(
    ("num_chunks", "fails", "stop_after", "released"),
    [
        (3, True, None, ["r"]),  # the decode worker died after answering
        (0, True, None, ["r"]),  # ... or before (it may never have pulled)
        (3, False, None, []),  # finished: the decode worker unpinned it
        (3, False, 1, []),  # the client left once tokens came: so did it
    ],
)
def test_the_router_unpins_the_prompt_kv_when_the_decode_stream_fails(
    num_chunks, fails, stop_after, released
):
    calls = RecordingCalls(num_chunks, fails)

    async def run() -> None:
        chunks = held_flow(calls)
        if fails:
            with pytest.raises(AttemptFailed):
                await drain(chunks, stop_after)
        else:
            await drain(chunks, stop_after)

    asyncio.run(run())
    assert calls.released == released


def test_a_cancel_during_the_release_ends_the_request_instead_of_migrating_it():
    """The decode stream failed, and the client left while the router unpinned the KV:
    the request ends (CancelledError), rather than move on to a new attempt (which
    could even re-prefill the same request id while the unpin is still on its way)."""
    calls = RecordingCalls(3, fails=True, cancelled_meanwhile=True)

    async def run() -> None:
        with pytest.raises(asyncio.CancelledError):
            await drain(held_flow(calls))

    asyncio.run(run())
    assert calls.released == ["r"]

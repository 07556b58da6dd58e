"""How a worker answers for a request whose grammar could not start (`CannotStart`).

It did not compile in time: RESOURCE_EXHAUSTED (the engine is busy compiling; the router
answers 429 with `Retry-After`). The grammar, or the replay of the tokens it had already
accepted (after a migration), was refused: INVALID_ARGUMENT (400). Before, such a
request ended `abort` with no token: a prefill worker's call INTERNAL, which the router
took for the worker's failure and migrated, and a decode worker's stream finished
normally, so the client got 200 with empty text and `finish_reason: "abort"` after two
30 s compile timeouts.
"""

from __future__ import annotations

import grpc

from tandem.engine.outputs import CannotStart


async def abort_cannot_start(
    context: grpc.aio.ServicerContext, req_id: str, failure: CannotStart
) -> None:
    code = (
        grpc.StatusCode.RESOURCE_EXHAUSTED if failure.timed_out
        else grpc.StatusCode.INVALID_ARGUMENT
    )  # fmt: skip
    await context.abort(code, f"request {req_id} cannot start: {failure.reason}")

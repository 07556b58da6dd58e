"""The prefill side's NCCL and cuda_ipc channels that a gone decode worker left behind.

A decode worker closes a channel no pull has used for `DECODE_IDLE_CLOSE_S`
(`KvTransferClient`, by CloseChannel) and opens a new one on its next pull. One that was
killed, or whose node was lost, closes nothing: its TCP channels end with their sockets,
but an NCCL channel would keep its communicator (GPU memory) and a cuda_ipc channel its
entry for as long as the prefill worker runs, one more for every decode worker that
autoscaling or healing replaced. So the transfer service closes the NCCL and cuda_ipc
channels no call has used for `PREFILL_IDLE_CLOSE_S`: by then a live decode worker has
closed its own, so only a gone one's are left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)

# A decode worker closes a channel no pull has used for this long (reopened by the next
# pull, in milliseconds).
DECODE_IDLE_CLOSE_S = 60.0
# The prefill side closes an NCCL or cuda_ipc channel no call has used for this long: a
# multiple of the decode side's limit, so that a live decode worker has closed it first.
PREFILL_IDLE_CLOSE_S = 3 * DECODE_IDLE_CLOSE_S


class IdleChannels(Generic[Key]):
    """When each channel was last opened or used; which have been idle too long. Both
    sides use it: the prefill service keyed by channel id, the decode client by prefill
    worker."""

    def __init__(self, idle_close_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if idle_close_s <= 0:
            raise ValueError(f"idle_close_s must be > 0, got {idle_close_s}")
        self.idle_close_s = idle_close_s
        self._clock = clock
        self._last_used: dict[Key, float] = {}

    def touch(self, channel_id: Key) -> None:
        """The channel was opened or used now."""
        self._last_used[channel_id] = self._clock()

    def forget(self, channel_id: Key) -> None:
        self._last_used.pop(channel_id, None)

    def idle(self) -> list[Key]:
        """The channels no call has used for `idle_close_s`."""
        since = self._clock() - self.idle_close_s
        return [channel_id for channel_id, used in self._last_used.items() if used <= since]

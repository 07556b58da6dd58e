"""Which of the prefill side's NCCL and cuda_ipc channels count as left behind."""

from __future__ import annotations

import pytest

from tandem.kv_transfer.idle_channels import (
    DECODE_IDLE_CLOSE_S,
    PREFILL_IDLE_CLOSE_S,
    IdleChannels,
)
from tests.helpers.clock import FakeClock


def test_a_channel_is_idle_once_unused_for_the_limit() -> None:
    clock = FakeClock()
    channels = IdleChannels(10.0, clock=clock)
    channels.touch("a")
    clock.advance(5.0)
    channels.touch("b")
    clock.advance(4.9)
    assert channels.idle() == []
    clock.advance(0.1)
    assert channels.idle() == ["a"]
    channels.touch("a")  # used again: its clock starts over
    clock.advance(5.0)
    assert channels.idle() == ["b"]
    channels.forget("b")
    channels.forget("never-seen")
    assert channels.idle() == []


def test_a_live_decode_worker_closes_its_channel_first() -> None:
    # The decode side checks every quarter of its limit, so it may close up to 1.25x late.
    assert PREFILL_IDLE_CLOSE_S > 1.25 * DECODE_IDLE_CLOSE_S
    with pytest.raises(ValueError, match="idle_close_s must be > 0"):
        IdleChannels(0.0)

"""Transfer pins: blocks a transfer thread touches are never reused under it.

`KvPins` on its own, then the engine's two uses: held prefill blocks sent in place
(release, lease expiry and eviction wait for the unpin) and reserved decode blocks
received in place (commit refuses, cancel defers the free). Pools end idle.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.kv_pins import KvPins
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tests.helpers.clock import FakeClock
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def test_retired_entry_is_freed_after_the_last_unpin() -> None:
    pins, freed = KvPins(torch.zeros(1)), []
    pins.open("a", [3, 4])
    first, second = pins.acquire("a"), pins.acquire("a")
    assert first.block_ids == [3, 4] and pins.is_pinned("a")
    assert not pins.retire("a", lambda: freed.append("a"))
    with pytest.raises(KeyError):
        pins.acquire("a")  # retired: no new pins
    first.unpin()
    first.unpin()  # idempotent: still one pin left
    assert pins.collect() == 0 and freed == []
    second.unpin()
    assert pins.collect() == 1 and freed == ["a"] and pins.num_pinned == 0
    # Unpinned entries are freed at once; closing a pinned one is refused.
    pins.open("b", [1])
    assert pins.retire("b", lambda: freed.append("b")) and freed == ["a", "b"]
    pins.open("c", [2])
    held = pins.acquire("c")
    with pytest.raises(RuntimeError, match="still being transferred"):
        pins.close("c")
    held.unpin()
    pins.close("c")
    with pytest.raises(KeyError):
        pins.acquire("c")


def test_pins_from_many_threads_balance() -> None:
    pins, freed = KvPins(torch.zeros(1)), []
    pins.open("a", [0])

    def pull() -> None:
        for _ in range(200):
            pins.acquire("a").unpin()

    threads = [threading.Thread(target=pull) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert pins.num_pinned == 0
    assert pins.retire("a", lambda: freed.append("a")) and freed == ["a"]


def make_engine(model_dir, mode: EngineMode, num_blocks: int, clock=None) -> Engine:
    config = EngineConfig(
        model=str(model_dir), max_model_len=1024, mode=mode, num_blocks=num_blocks
    )
    return Engine(config, clock=clock or FakeClock())


def drain(engine: Engine) -> None:
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("engine did not finish")


def test_eviction_cannot_overwrite_blocks_pinned_by_a_send(tiny_model_dir) -> None:
    """Mid-pull, the lease runs out and other prompts fill the pool: the pinned blocks
    are neither handed out nor written until the send unpins them."""
    clock = FakeClock()
    engine = make_engine(tiny_model_dir, EngineMode.PREFILL_ONLY, num_blocks=24, clock=clock)
    prompts = make_prompts(2048, (150, 150, 150, 150), seed=5)
    engine.add_request("a", prompts[0], GREEDY)
    drain(engine)
    pinned = engine.acquire_held_kv("a")  # what a transfer thread does at pull start
    assert pinned.kv_cache is engine.runner.kv_caches
    assert pinned.block_ids == engine.held_block_ids("a") and len(pinned.block_ids) == 10
    sent = pinned.kv_cache[:, :, pinned.block_ids].clone()
    clock.advance(engine.config.kv_lease_s + 1)
    assert engine.expire_leases(clock()) == ["a"]  # the lease ends mid-send
    assert engine.pool.num_free_blocks == 14  # still pinned: not reusable
    with pytest.raises(KeyError):
        engine.acquire_held_kv("a")  # no new pull of released KV
    # Other prompts take every free block, evicting cached prefixes, request by request.
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(f"b{i}", prompt, GREEDY)
        drain(engine)
        engine.release(f"b{i}")
    assert all(engine.pool.ref_cnt(b) == 1 for b in pinned.block_ids)
    assert torch.equal(pinned.kv_cache[:, :, pinned.block_ids], sent)
    pinned.unpin()  # the send ended
    engine.expire_leases(clock())  # the engine's next step or idle wake-up
    assert engine.is_idle()


def test_receive_view_is_pinned_until_the_writer_lets_go(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir, EngineMode.DECODE_ONLY, num_blocks=16)
    prompt = make_prompts(2048, (40,), seed=6)[0]
    with pytest.raises(KeyError):
        engine.acquire_import_kv("a")  # not receiving
    block_ids = engine.reserve_import("a", prompt, 7, GREEDY)
    view = engine.acquire_import_kv("a")
    assert view.block_ids == block_ids and view.kv_cache is engine.runner.kv_caches
    with pytest.raises(RuntimeError, match="still being transferred"):
        engine.commit_import("a")  # the step must never read half-written blocks
    assert engine.cancel_import("a")  # e.g. the pull timed out; its thread still runs
    assert engine.pool.num_free_blocks == 16 - len(block_ids)
    view.unpin()
    engine.expire_leases(0.0)
    assert engine.is_idle()
    # The normal path: written, unpinned, committed, decoded.
    engine.reserve_import("b", prompt, 7, GREEDY)
    view = engine.acquire_import_kv("b")
    view.unpin()
    engine.commit_import("b")
    with pytest.raises(KeyError):
        engine.acquire_import_kv("b")  # running now: no writer may touch it
    drain(engine)
    assert engine.is_idle()

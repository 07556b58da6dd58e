"""A process whose engine thread is always mid-step, exiting on SIGTERM as a Ray worker
does (its handler raises SystemExit): `python -m tests.helpers.busy_engine_process
MODEL_DIR` prints BUSY once requests run, then keeps generating until signalled, or until
its stdin closes (a test that died leaves no orphan)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import threading

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.worker.engine_loop import EngineLoop
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES


async def generate_forever(loop: EngineLoop) -> None:
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for round_ in range(sys.maxsize):
        streams = [
            await loop.generate(f"r{round_}-{i}", list(range(1, 200)), params) for i in range(8)
        ]
        if round_ == 0:
            print("BUSY", flush=True)
        for stream in streams:
            async with stream:
                async for _ in stream:
                    pass


def exit_when_stdin_closes() -> None:
    sys.stdin.read()
    os._exit(0)


def main(model_dir: str) -> None:
    threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
    config = EngineConfig(
        model=model_dir, num_threads=1, max_model_len=512, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES
    )
    loop = EngineLoop(functools.partial(Engine, config), name="engine-busy")
    loop.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # Ray's workers: SystemExit
    asyncio.run(generate_forever(loop))


if __name__ == "__main__":
    main(sys.argv[1])

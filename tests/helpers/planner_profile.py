"""A documented profile.json for planner tests, generated from known latency laws.

Prefill: 5 ms + 40 µs/token + attention; decode: 8 ms + 0.2 ms/sequence + 40 ns per
context token; KV pulls: 1 ms + 2 µs/token. Samples lie exactly on those laws, so a
fit recovers them.
"""

from __future__ import annotations

import json
from pathlib import Path

PREFILL = (5e-3, 4e-5, 1e-9)  # fixed s, s/token, s per attention pair
DECODE = (8e-3, 2e-4, 4e-8)  # fixed s, s/sequence, s/context token
TRANSFER = (1e-3, 2e-6)  # fixed s, s/token


def profile_json() -> dict:
    def prefill_s(new: int, cached: int) -> float:
        return PREFILL[0] + PREFILL[1] * new + PREFILL[2] * new * (cached + new / 2)

    prefill = [
        {"prompt_tokens": n, "cached_tokens": c, "seconds": prefill_s(n - c, c)}
        for n in (32, 128, 512, 1024, 2048)
        for c in (0, n // 2)
    ]
    decode = [
        {"batch_size": b, "context_tokens": b * ctx,
         "seconds": DECODE[0] + DECODE[1] * b + DECODE[2] * b * ctx}
        for b in (1, 4, 16, 64) for ctx in (128, 1024)
    ]  # fmt: skip
    transfer = [
        {"num_tokens": n, "num_bytes": n * 4096, "seconds": TRANSFER[0] + TRANSFER[1] * n}
        for n in (256, 2048, 8192)
    ]
    return {
        "format": "tandem-profile",
        "version": 1,
        "hardware": {"device": "cpu", "processor": "test", "num_threads": 2, "dtype": "float32"},
        "model": {"path": "test", "num_layers": 4, "kv_bytes_per_token": 4096},
        "engine": {
            "block_size": 16,
            "max_num_batched_tokens": 512,
            "max_num_seqs": 64,
            "num_blocks": 20000,
            "max_model_len": 4096,
        },
        "prefill": prefill,
        "decode": decode,
        "transfer": transfer,
    }


def write_profile(path: Path) -> Path:
    path.write_text(json.dumps(profile_json()))
    return path

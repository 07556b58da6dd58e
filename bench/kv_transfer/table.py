"""The KV transfer benchmark's results and the docs section they become."""

from __future__ import annotations

import dataclasses
import platform
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem.bench.report import machine_sentence, render_table
from tandem.kv_transfer import KvLayout

# Every variant but "raw", in table order, with its column heading.
VARIANTS = {
    "production": "production GB/s",
    "adjacent": "production, adjacent blocks",
    "pull": "into memory",
    "fresh": "fresh memory",
    "export": "export + write (old)",
}


@dataclasses.dataclass
class Row:
    num_tokens: int
    nbytes: int
    # "raw", "production" (pinned cache blocks -> pinned reserved cache blocks, both
    # shuffled), "adjacent" (the same, ascending adjacent blocks on both sides), "pull"
    # (into recycled memory), "fresh" (no recycling), "export" (the old path: a copy
    # served, received into memory, copied into the cache) -> seconds, one per round
    times_s: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def gbps(self, name: str) -> float:
        return self.nbytes / statistics.median(self.times_s[name]) / 1e9

    def vs_raw(self, name: str) -> float:  # back to back per round: load hits both alike
        pairs = zip(self.times_s["raw"], self.times_s[name], strict=True)
        return statistics.median(raw / t for raw, t in pairs)


def method(layout: KvLayout, repeats: int) -> str:
    return (
        f"**Method.** Layout `{layout.fingerprint()}` (16-token blocks of 16 KiB per layer "
        "and K/V). Two processes on loopback. *Production* is the code the workers run: the "
        "prefill process serves through `prefill_worker.server.serve_held_kv` (blocks pinned "
        "in a `KvPins` over a paged cache, `KvTransferService` behind a real gRPC server) "
        "and the decode process pulls through `decode_worker.service.pull_into_pinned` "
        "(`KvTransferClient`, tcp) into pinned reserved blocks of its own paged cache; block "
        "ids are shuffled on both sides (as in a used pool: every block its own iovec) and "
        "the payload is checked bit for bit. *Raw* is the reference: `sendall`/`recv_into` "
        "of the same number of bytes, contiguous, between the same two processes on a socket "
        "tuned alike. *Adjacent blocks*: production with ascending blocks on both sides (a "
        "fresh pool). *Into memory*/*fresh memory*: the pull into recycled/new memory "
        "instead of cache blocks. *Export + write*: the path before zero-copy (a copy "
        f"served, received, copied into the cache). {repeats} rounds after a warm-up "
        f"({repeats} × 8192 / tokens below 8k tokens), every variant back to back in each "
        "round; GB/s from the median time; (vs raw) = the median over rounds of raw time / "
        "variant time."
    )


def render(
    command: str,
    facts: dict[str, Any],
    load_end: Sequence[float],
    layout: KvLayout,
    repeats: int,
    rows: list[Row],
    prefill: Callable[[int], float],
    measured: Sequence[int],
    prefill_note: str,
) -> str:
    """The generated block: command, machine, method, table, prefill note."""
    cells = []
    for r in rows:
        pull_s, prefill_s = statistics.median(r.times_s["production"]), prefill(r.num_tokens)
        cells.append(
            [f"{r.num_tokens:,}", f"{r.nbytes / 2**20:.0f}", f"{r.gbps('raw'):.2f}",
             f"{r.gbps('production'):.2f}", f"**{r.vs_raw('production'):.0%}**",
             *(f"{r.gbps(n):.2f} ({r.vs_raw(n):.0%})" for n in list(VARIANTS)[1:]),
             f"{prefill_s:.1f}{'' if r.num_tokens in measured else '*'}",
             f"{pull_s / prefill_s:.2%}"]
        )  # fmt: skip
    header = [
        "prompt tokens", "KV MiB", "raw GB/s", "production GB/s", "production vs raw",
        *list(VARIANTS.values())[1:], "prefill s", "transfer / prefill",
    ]  # fmt: skip
    machine = (
        f"{machine_sentence(facts, load_end)} Linux {platform.release()}, "
        f"torch {torch.__version__}."
    )
    return "\n".join(
        [
            f"`{command}`",
            "",
            machine,
            "",
            method(layout, repeats),
            "",
            render_table(header, cells),
            "",
            f"Prefill time (* = extrapolated): {prefill_note}",
        ]
    )

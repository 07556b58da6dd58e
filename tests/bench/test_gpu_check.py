"""`tandem-bench gpu-check --dry-run`: every step of the prepared GPU run, on the CPU with
tiny shapes (the numbers mean nothing; the code paths and the section are checked):
engine equality with graphs auto/off, a served 1P+1D cluster (`tandem serve` processes,
`--kv-backend auto`), two-process KV pulls, the 8B-shaped steps at tiny size."""

from __future__ import annotations

import math

import pytest

from tandem.bench.cli import main
from tandem.bench.gpu_check import LLAMA3_8B, SECTION_HEADING

pytestmark = pytest.mark.timeout(600)


def test_dry_run_writes_the_section(tmp_path) -> None:
    out = tmp_path / "benchmarks.md"
    assert main(["gpu-check", "--dry-run", "--out", str(out), "--workdir", str(tmp_path)]) == 0
    text = out.read_text()
    assert SECTION_HEADING in text and "dry run on the CPU" in text
    # The engine with graphs `auto` (off on a CPU) and off, a served 1P+1D cluster.
    assert "graphs `auto` **3/3 prompts equal** (0 decode steps through the graphs)" in text
    assert "graphs off **3/3**" in text and "`--kv-backend auto` **3/3**" in text
    # Two-process pulls (cuda_ipc on a GPU, auto = tcp on a CPU), checked bit for bit.
    assert "between two processes over `auto`" in text and "(bit-exact)" in text
    assert "| 1 |" in text and "| 2 |" in text and "MFU" in text and "GB/s" in text
    assert not list(tmp_path.glob("tmp*"))  # random checkpoints removed


def test_the_real_run_is_8b_shaped() -> None:
    num_params = sum(math.prod(dims) for dims in LLAMA3_8B.weights().values())
    assert 8.0e9 < num_params < 8.1e9  # Llama 3 8B: 8.03e9

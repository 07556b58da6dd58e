"""The cpu ops' build lock: a build killed midway leaves torch's lock file behind, and
every later load waited on it forever; Tandem's own lock (a kernel file lock, freed with
its holder) makes that file stale, removed by the next load."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from tandem.engine.cpu_ops import loader

pytestmark = pytest.mark.timeout(300)

HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tandem.engine.cpu_ops.loader import build_lock
    with build_lock(Path(sys.argv[1]), 5.0):
        print("held", flush=True)
        time.sleep(60)
    """
)


def test_the_lock_clears_a_killed_builds_file_and_waits_for_a_live_builder(tmp_path):
    build_dir = tmp_path / "tandem_cpu_ops_test"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what a build killed midway leaves
    with loader.build_lock(build_dir, 5.0):
        assert not (build_dir / "lock").exists()
    # Another process building: this one waits, and gives up past its timeout.
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(build_dir)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="held"), loader.build_lock(build_dir, 0.5):
            pass
        assert 0.5 <= time.monotonic() - started < 5.0
        holder.kill()  # killed, not released: the kernel frees the lock with the process
        holder.wait(timeout=30)
        with loader.build_lock(build_dir, 5.0):
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_loading_the_ops_after_a_killed_build_does_not_hang():
    """The real cache: torch's lock file left in the ops' build folder; a fresh process
    loads the (cached) ops at once and the file is gone."""
    assert loader.cpu_ops_error() is None
    build_dir = loader.build_directory(loader.extension_name())
    stale = build_dir / "lock"
    stale.touch()
    try:
        load = "from tandem.engine.cpu_ops import loader; print(loader.cpu_ops_error())"
        result = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True,
                                timeout=120)  # fmt: skip
        assert result.stdout.strip() == "None", result.stderr[-2000:]
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_two_installs_keep_a_build_each(tmp_path, monkeypatch):
    """The same sources in another folder (a clone beside a checkout) name another cache
    folder of the same CPU's: torch's build file names the sources by path, and one
    shared folder was rebuilt whenever the other install had loaded it last."""
    here = loader.extension_name()
    monkeypatch.setattr(loader, "SOURCES", [tmp_path / "cpu_ops" / s.name for s in loader.SOURCES])
    there = loader.extension_name()
    assert here != there
    assert (
        here.rsplit("_", 1)[0]
        == there.rsplit("_", 1)[0]
        == (f"{loader.EXTENSION_BASE_NAME}_{loader.cpu_fingerprint()}")
    )

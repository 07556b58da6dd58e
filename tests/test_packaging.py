"""Installed, Tandem occupies one import namespace: every file of the wheel is under `tandem/`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_wheel_installs_only_the_tandem_namespace(tmp_path: Path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=240,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("tandem-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    dist_info = {name for name in top_level if name.endswith(".dist-info")}
    assert top_level - dist_info == {"tandem"}, sorted(top_level)
    # The namespace has no __init__ of its own; each design folder is a package under it.
    assert "tandem/__init__.py" not in names
    for package in ("engine", "worker", "router", "kv_transfer", "proto", "cluster"):
        assert f"tandem/{package}/__init__.py" in names, package
    assert "tandem/proto/tandem/worker/v1/worker_pb2.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "tandem = tandem.cluster.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

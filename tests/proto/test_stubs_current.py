"""The committed protobuf stubs are exactly what `make proto` generates."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


@pytest.mark.timeout(120)
def test_generated_stubs_match_proto_sources(tmp_path):
    protos = sorted(p.relative_to(ROOT) for p in (ROOT / "proto").rglob("*.proto"))
    assert protos, "no .proto sources found"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *map(str, protos),
        ],
        cwd=ROOT,
        check=True,
        timeout=100,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(
        p.relative_to(ROOT)
        for p in (ROOT / "proto").rglob("*")
        if p.name.endswith(GENERATED_SUFFIXES)
    )
    assert generated == committed, "stub files differ from the .proto sources: run `make proto`"
    for rel in generated:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), (
            f"{rel} drifted: run `make proto`"
        )

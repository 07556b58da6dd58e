"""Generates the Python stubs next to the `.proto` sources (`make proto` runs this).

The sources are compiled under the virtual path `tandem/proto/`, so the stubs import
each other as `tandem.proto...`, the package they install as. Needs `grpcio-tools`
(the `dev` extra), pinned so the output does not drift between machines.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
VIRTUAL_ROOT = "tandem/proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_sources() -> list[Path]:
    """Every `.proto` file, relative to the proto folder."""
    return sorted(p.relative_to(PROTO_DIR) for p in PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path, timeout_s: float = 120.0) -> list[Path]:
    """Writes the stubs under `out_dir` (same relative paths as the sources); returns them."""
    sources = proto_sources()
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{VIRTUAL_ROOT}={PROTO_DIR}",
                f"--python_out={scratch}",
                f"--grpc_python_out={scratch}",
                f"--pyi_out={scratch}",
                *(f"{VIRTUAL_ROOT}/{source}" for source in sources),
            ],
            check=True,
            timeout=timeout_s,
        )
        generated_root = Path(scratch) / VIRTUAL_ROOT
        written = []
        for path in sorted(generated_root.rglob("*")):
            if path.is_file():
                rel = path.relative_to(generated_root)
                (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, out_dir / rel)
                written.append(rel)
    return written


def committed_stubs() -> list[Path]:
    """The stub files in the proto folder, relative to it."""
    return sorted(
        p.relative_to(PROTO_DIR)
        for p in PROTO_DIR.rglob("*")
        if p.name.endswith(GENERATED_SUFFIXES)
    )


if __name__ == "__main__":
    for stub in generate(PROTO_DIR):
        print(f"proto/{stub}")

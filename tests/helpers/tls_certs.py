"""A throwaway CA and certificates for internal-TLS tests, made with the `openssl` CLI."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_TIMEOUT_S = 30
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path
    ca: Path


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True,
                   timeout=_TIMEOUT_S)  # fmt: skip


def make_ca(out_dir: Path, name: str = "tandem-test-ca") -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cert, key = out_dir / f"{name}.pem", out_dir / f"{name}.key"
    _openssl("req", "-x509", *_EC, "-keyout", str(key), "-out", str(cert), "-days", "2",
             "-subj", f"/CN={name}", cwd=out_dir)  # fmt: skip
    return cert, key


def make_cert(out_dir: Path, ca: tuple[Path, Path], name: str, dns_names: list[str]) -> CertFiles:
    """A certificate for servers and clients alike (serverAuth + clientAuth), signed by
    `ca`, valid for `dns_names` only."""
    ca_cert, ca_key = ca
    cert, key, csr = (out_dir / f"{name}.{ext}" for ext in ("pem", "key", "csr"))
    ext = out_dir / f"{name}.ext"
    ext.write_text(
        "subjectAltName=" + ",".join(f"DNS:{n}" for n in dns_names) + "\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl("req", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}",
             cwd=out_dir)  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext),
             cwd=out_dir)  # fmt: skip
    return CertFiles(cert=cert, key=key, ca=ca_cert)

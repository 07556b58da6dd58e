"""Which attention backend an engine runs (`auto`, `torch`, `triton`, `cpu`), checked at start-up.

`auto` is Triton on CUDA and, on CPU, the `cpu` backend (decodes through a C++ op that
reads the paged cache in place; built once per machine) where that op builds, else the
torch backend (gathered blocks + SDPA) with a warning saying why. Asking for a backend
that cannot run here is a ValueError naming why, never a silent fallback: Triton must
import, and on CPU it runs only under its interpreter (`TRITON_INTERPRET=1`, read when
the kernels are imported: set it before start-up); `cpu` runs on device cpu only, where
its op builds (g++ and ninja).
"""

from __future__ import annotations

import enum
import logging
import os
from typing import Any

from tandem.engine.attention.backend import AttentionBackend
from tandem.engine.attention.cpu_paged_backend import CpuPagedAttentionBackend
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.cpu_ops.loader import cpu_ops_error

logger = logging.getLogger(__name__)


class AttentionBackendName(enum.StrEnum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    CPU = "cpu"


def triton_import_error() -> str | None:
    """Why `import triton` fails here, or None when it works."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken install's own error
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_attention_backend(name: str, device: str) -> AttentionBackendName:
    """The backend `name` stands for on `device` ('cpu', 'cuda', 'cuda:N'); ValueError
    when it is unknown or cannot run here."""
    choices = ", ".join(b.value for b in AttentionBackendName)
    try:
        chosen = AttentionBackendName(name)
    except ValueError:
        raise ValueError(f"attention_backend must be one of {choices}, got {name!r}") from None
    on_cpu = device == "cpu"
    if chosen is AttentionBackendName.AUTO:
        if on_cpu:
            error = cpu_ops_error()
            if error is None:
                return AttentionBackendName.CPU
            logger.warning(
                "attention backend auto: the cpu op does not build (%s); using torch", error
            )
            return AttentionBackendName.TORCH
        error = triton_import_error()
        if error is None:
            return AttentionBackendName.TRITON
        logger.warning("attention backend auto: triton does not import (%s); using torch", error)
        return AttentionBackendName.TORCH
    if chosen is AttentionBackendName.TRITON:
        error = triton_import_error()
        if error is not None:
            raise ValueError(f"attention_backend triton: triton cannot be imported ({error})")
        if on_cpu and not triton_interpreting():
            raise ValueError(
                "attention_backend triton on device cpu runs only under Triton's interpreter "
                "(set TRITON_INTERPRET=1 before start-up; slow, for tests); "
                "use 'torch' or 'auto' to serve on CPU"
            )
    if chosen is AttentionBackendName.CPU:
        if not on_cpu:
            raise ValueError(f"attention_backend cpu runs on device cpu only, not {device}")
        error = cpu_ops_error()
        if error is not None:
            raise ValueError(f"attention_backend cpu: its C++ op does not build here ({error})")
    return chosen


def get_attention_backend(name: str, scale: float, device: str = "cpu") -> AttentionBackend[Any]:
    """A new backend instance for `name` (resolved and checked for `device`)."""
    resolved = resolve_attention_backend(name, device)
    if resolved is AttentionBackendName.TRITON:
        # Imported here, after the checks: the kernels' form is fixed at import.
        from tandem.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(scale)
    if resolved is AttentionBackendName.CPU:
        return CpuPagedAttentionBackend(scale)
    return TorchAttentionBackend(scale)

"""A small ctypes binding to NCCL: unique ids, 2-rank communicators, send and recv.

Only what the `nccl` backend needs, with no torch.distributed process group, so a
(decode, prefill) pair gets its own communicator whenever a channel opens. Importing
this module needs neither CUDA nor NCCL; `load_nccl()` raises `NcclError` then.
The library comes from the `nvidia-nccl-cu12` wheel (`nvidia/nccl/lib/libnccl.so.2`),
else torch's own lib directory, else the system's `libnccl`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from tandem.kv_transfer.errors import KvTransferError

logger = logging.getLogger(__name__)

NCCL_UNIQUE_ID_BYTES = 128
_NCCL_UINT8 = 1  # ncclDataType_t ncclUint8: every payload is sent as raw bytes


class NcclError(KvTransferError):
    """NCCL is missing or one of its calls failed."""


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def find_nccl_library() -> str:
    candidates: list[Path] = []
    try:
        import nvidia.nccl  # type: ignore[import-not-found]

        candidates += [Path(p) / "lib" / "libnccl.so.2" for p in nvidia.nccl.__path__]
    except ImportError:
        pass
    candidates.append(Path(torch.__file__).parent / "lib" / "libnccl.so.2")
    for path in candidates:
        if path.is_file():
            return str(path)
    system = ctypes.util.find_library("nccl")
    if system:
        return system
    raise NcclError("libnccl not found (install nvidia-nccl-cu12 or a CUDA build of torch)")


class NcclLibrary:
    """The NCCL entry points; every call raises NcclError on a non-zero result."""

    def __init__(self, path: str) -> None:
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise NcclError(f"cannot load {path}: {e}") from e
        self.path = path
        vp, size, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self._lib.ncclGetErrorString.restype = ctypes.c_char_p
        self._lib.ncclGetErrorString.argtypes = [i]
        self._fns = {
            "ncclGetVersion": [ctypes.POINTER(i)],
            "ncclGetUniqueId": [ctypes.POINTER(NcclUniqueId)],
            "ncclCommInitRank": [ctypes.POINTER(vp), i, NcclUniqueId, i],
            "ncclSend": [vp, size, i, i, vp, vp],
            "ncclRecv": [vp, size, i, i, vp, vp],
            "ncclCommDestroy": [vp],
            "ncclCommAbort": [vp],
        }
        for name, argtypes in self._fns.items():
            fn = getattr(self._lib, name)
            fn.argtypes, fn.restype = argtypes, i

    def _call(self, name: str, *args: Any) -> None:
        result = getattr(self._lib, name)(*args)
        if result != 0:
            message = self._lib.ncclGetErrorString(result).decode(errors="replace")
            raise NcclError(f"{name} failed ({result}): {message}")

    def version(self) -> int:
        version = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.byref(version))
        return version.value

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return bytes(uid.internal)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """Blocks until all `nranks` ranks joined; uses the calling thread's CUDA device."""
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise NcclError(f"NCCL unique id must be {NCCL_UNIQUE_ID_BYTES} bytes")
        comm = ctypes.c_void_p()
        uid = NcclUniqueId.from_buffer_copy(unique_id)
        self._call("ncclCommInitRank", ctypes.byref(comm), nranks, uid, rank)
        if not comm.value:
            raise NcclError("ncclCommInitRank returned a null communicator")
        return comm.value

    def send(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self._call("ncclSend", ptr, nbytes, _NCCL_UINT8, peer, comm, stream)

    def recv(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self._call("ncclRecv", ptr, nbytes, _NCCL_UINT8, peer, comm, stream)

    def comm_destroy(self, comm: int) -> None:
        self._call("ncclCommDestroy", comm)

    def comm_abort(self, comm: int) -> None:
        self._call("ncclCommAbort", comm)


@functools.cache
def load_nccl() -> NcclLibrary:
    """The process's NCCL (loaded once); NcclError without CUDA or libnccl."""
    if not torch.cuda.is_available():
        raise NcclError("the nccl KV backend needs CUDA")
    lib = NcclLibrary(find_nccl_library())
    logger.info("NCCL %d loaded from %s", lib.version(), lib.path)
    return lib


class NcclComm:
    """A communicator of one channel with its side stream (used by one pull at a time)."""

    def __init__(self, lib: NcclLibrary, handle: int, device: torch.device) -> None:
        self.lib = lib
        self.device = device
        self._handle: int | None = handle
        self.stream = torch.cuda.Stream(device)

    @classmethod
    def init(
        cls, lib: NcclLibrary, unique_id: bytes, nranks: int, rank: int, device: torch.device
    ) -> NcclComm:
        """Blocking: run in a thread, concurrently with the peer's init."""
        with torch.cuda.device(device):
            return cls(lib, lib.comm_init_rank(nranks, unique_id, rank), device)

    def send(self, tensor: torch.Tensor, peer: int) -> torch.cuda.Event:
        return self._post(self.lib.send, tensor, peer)

    def recv(self, tensor: torch.Tensor, peer: int) -> torch.cuda.Event:
        return self._post(self.lib.recv, tensor, peer)

    def _post(self, op: Any, tensor: torch.Tensor, peer: int) -> torch.cuda.Event:
        """Enqueue `op` on the side stream after the work that made `tensor`; returns its
        completion event."""
        if self._handle is None:
            raise NcclError("NCCL communicator already closed")
        if tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(f"NCCL needs a contiguous tensor on {self.device}")
        with torch.cuda.device(self.device):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            if tensor.numel():
                op(tensor.data_ptr(), tensor.nbytes, peer, self._handle, self.stream.cuda_stream)
            # The caching allocator must not reuse the memory before the side stream is done.
            tensor.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def close(self, abort: bool = False) -> None:
        """Destroy (or abort, when an operation may still be pending) the communicator."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            (self.lib.comm_abort if abort else self.lib.comm_destroy)(handle)
        except NcclError as e:
            logger.warning("closing NCCL communicator: %s", e)

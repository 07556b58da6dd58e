"""The `cuda_ipc` backend's pieces: where a worker runs, which backend a worker pair
gets, and the prefill cache's CUDA IPC handle.

NCCL refuses two ranks on one GPU, so workers that share a node (or a GPU) move KV by
CUDA IPC instead: the prefill worker exports its paged cache once per channel (the
cache is allocated once, at start-up), the decode worker opens it once and copies a
pull's blocks device to device. `choose_channel_backend` is the whole rule set, run by
the prefill side when a channel opens (`auto`: same process -> tcp, same node -> cuda_ipc,
other nodes -> nccl; CPU on either side -> tcp); impossible explicit choices raise
`BackendRefused` with the reason, which the decode side gets as a start-up error.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.kv_transfer.errors import KvTransferError
from tandem.kv_transfer.layout import dtype_name

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class BackendRefused(KvTransferError):
    """The requested backend cannot connect this pair of workers (the message says why)."""


def node_id() -> str:
    """This machine's identity: host name and boot id (a container shares its host's)."""
    boot = _BOOT_ID.read_text().strip() if _BOOT_ID.is_file() else ""
    return f"{socket.gethostname()}/{boot}"


def gpu_uuid(device: torch.device | str | None) -> str:
    """The CUDA device's UUID (stable across processes and CUDA_VISIBLE_DEVICES), or ""
    for a CPU device."""
    if device is None or torch.device(device).type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


@dataclass(frozen=True)
class Placement:
    """Where a worker's engine runs."""

    node_id: str
    pid: int
    # "" when the engine runs on the CPU.
    gpu_uuid: str

    @classmethod
    def here(cls, device: torch.device | str | None) -> Placement:
        return cls(node_id(), os.getpid(), gpu_uuid(device))


def choose_channel_backend(
    requested: str, decode: Placement, prefill: Placement, nccl_offered: bool
) -> str:
    """The backend ('tcp', 'nccl' or 'cuda_ipc') of a channel from `decode` to `prefill`
    for a requested 'auto', 'tcp', 'nccl' or 'cuda_ipc'; BackendRefused when it cannot
    work. `nccl_offered`: the decode side sent an NCCL unique id."""
    on_gpus = bool(decode.gpu_uuid and prefill.gpu_uuid)
    same_node = decode.node_id == prefill.node_id
    same_process = same_node and decode.pid == prefill.pid
    if requested == "tcp":
        return "tcp"
    if requested == "auto":
        if not on_gpus or same_process:
            return "tcp"
        requested = "cuda_ipc" if same_node else "nccl"
    if requested not in ("nccl", "cuda_ipc"):
        raise BackendRefused(f"unknown KV backend {requested!r}")
    if not on_gpus:
        raise BackendRefused(f"kv backend {requested} needs GPU engines on both workers")
    if requested == "cuda_ipc":
        if not same_node:
            raise BackendRefused(
                f"kv backend cuda_ipc needs both workers on one node (decode on "
                f"{decode.node_id}, prefill on {prefill.node_id}); use nccl or auto"
            )
        if same_process:
            raise BackendRefused("kv backend cuda_ipc needs the workers in two processes")
        return "cuda_ipc"
    if decode.gpu_uuid == prefill.gpu_uuid:
        raise BackendRefused(
            "kv backend nccl cannot connect two workers on one GPU (NCCL refuses two ranks "
            "on one device); use cuda_ipc or auto"
        )
    if not nccl_offered:
        raise BackendRefused("kv backend nccl: NCCL is unavailable on the decode worker")
    return "nccl"


@dataclass(frozen=True)
class CudaIpcCache:
    """What another process needs to map a CUDA tensor (the prefill's paged cache)."""

    gpu_uuid: str
    # cudaIpcMemHandle of the allocation holding the storage, and the storage within it.
    mem_handle: str  # hex
    storage_size_bytes: int
    storage_offset_bytes: int
    # torch's producer-side reference counter and the event the consumer waits on.
    ref_counter_handle: str  # hex
    ref_counter_offset: int
    event_handle: str  # hex
    event_sync_required: bool
    size: tuple[int, ...]
    stride: tuple[int, ...]
    # Elements into the storage.
    offset: int
    dtype: str

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> CudaIpcCache:
        """ValueError when `data` is not a CudaIpcCache."""
        try:
            raw = json.loads(data)
            raw["size"], raw["stride"] = tuple(raw["size"]), tuple(raw["stride"])
            return cls(**raw)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"not a CUDA IPC cache description: {e}") from None

    @classmethod
    def export(cls, tensor: torch.Tensor) -> CudaIpcCache:
        """The IPC description of a CUDA tensor (its memory must outlive every importer)."""
        if not tensor.is_cuda:
            raise ValueError("only a CUDA tensor can be shared by CUDA IPC")
        shared = tensor.untyped_storage()._share_cuda_()
        _, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event, sync = shared
        return cls(
            gpu_uuid=gpu_uuid(tensor.device),
            mem_handle=bytes(handle).hex(),
            storage_size_bytes=int(size_bytes),
            storage_offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(ref_handle).hex(),
            ref_counter_offset=int(ref_offset),
            event_handle=bytes(event or b"").hex(),
            event_sync_required=bool(sync),
            size=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            offset=int(tensor.storage_offset()),
            dtype=dtype_name(tensor.dtype),
        )

    def open(self) -> torch.Tensor:
        """The exporter's tensor, mapped into this process (another process than the
        exporter's); KvTransferError when its GPU is not visible here."""
        torch.cuda.init()
        index = local_device_index(self.gpu_uuid, visible_gpu_uuids())
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            bytes.fromhex(self.mem_handle),
            self.storage_size_bytes,
            self.storage_offset_bytes,
            bytes.fromhex(self.ref_counter_handle),
            self.ref_counter_offset,
            bytes.fromhex(self.event_handle),  # bytes even when unused (torch checks)
            self.event_sync_required,
        )
        dtype = getattr(torch, self.dtype)
        tensor = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
        return tensor.set_(storage, self.offset, self.size, self.stride)


def visible_gpu_uuids() -> list[str]:
    """UUIDs of this process's CUDA devices, by index."""
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def local_device_index(uuid: str, visible: list[str]) -> int:
    """This process's index of the GPU `uuid`; KvTransferError when it is not visible."""
    if uuid in visible:
        return visible.index(uuid)
    raise KvTransferError(
        f"the prefill worker's GPU {uuid} is not visible to this decode worker "
        f"({len(visible)} visible; check CUDA_VISIBLE_DEVICES)"
    )

"""KV transfer: move a prefilled request's KV blocks from a prefill to a decode worker.

Prefill side: `KvTransferService` (gRPC `KvTransfer` + data plane). Decode side:
`KvTransferClient.pull(handle)`. Backends: `tcp` (CPU default), `local` (same
process), `nccl` (GPU). See docs/architecture.md ("KV transfer").
"""

from tandem.kv_transfer.blocks import CacheBlocks, ReadBlocks
from tandem.kv_transfer.client import KvTransferClient
from tandem.kv_transfer.errors import KvPullError, KvTransferError, LayoutMismatchError
from tandem.kv_transfer.handle import KvHandle
from tandem.kv_transfer.layout import KvLayout
from tandem.kv_transfer.local import LocalRegistry
from tandem.kv_transfer.service import KvTransferService
from tandem.kv_transfer.stats import TransferStats

__all__ = [
    "CacheBlocks",
    "KvHandle",
    "KvLayout",
    "KvPullError",
    "KvTransferClient",
    "KvTransferError",
    "KvTransferService",
    "LayoutMismatchError",
    "LocalRegistry",
    "ReadBlocks",
    "TransferStats",
]

"""`KvHandle`: where a prefilled request's KV lives; the router carries it to decode."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.proto.tandem.worker.v1 import worker_pb2


@dataclass
class KvHandle:
    # Prefill worker that holds the blocks.
    worker_id: str
    # That worker's gRPC address (KvTransfer service), "host:port".
    endpoint: str
    # Key of the held KV on the prefill worker.
    request_id: str
    # Pinned blocks in position order; the pull returns len(block_ids) blocks.
    block_ids: list[int] = field(default_factory=list)
    # Prompt positions covered by the blocks.
    num_tokens: int = 0
    layout_fingerprint: str = ""
    # The prefill worker frees the blocks after this (wall clock) if not pulled.
    lease_expiry_unix_s: float = 0.0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def to_proto(self) -> worker_pb2.KvHandle:
        return worker_pb2.KvHandle(
            worker_id=self.worker_id,
            endpoint=self.endpoint,
            request_id=self.request_id,
            block_ids=self.block_ids,
            num_tokens=self.num_tokens,
            layout_fingerprint=self.layout_fingerprint,
            lease_expiry_unix_s=self.lease_expiry_unix_s,
        )

    @classmethod
    def from_proto(cls, msg: worker_pb2.KvHandle) -> KvHandle:
        return cls(
            worker_id=msg.worker_id,
            endpoint=msg.endpoint,
            request_id=msg.request_id,
            block_ids=list(msg.block_ids),
            num_tokens=msg.num_tokens,
            layout_fingerprint=msg.layout_fingerprint,
            lease_expiry_unix_s=msg.lease_expiry_unix_s,
        )

"""Attention backends over the paged KV cache: torch (reference) and Triton kernels."""

from tandem.engine.attention.backend import AttentionBackend
from tandem.engine.attention.metadata import AttentionMetadata, BatchLayout
from tandem.engine.attention.selector import (
    AttentionBackendName,
    get_attention_backend,
    resolve_attention_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionBackendName",
    "AttentionMetadata",
    "BatchLayout",
    "get_attention_backend",
    "resolve_attention_backend",
]

"""Attention backends over the paged KV cache (torch reference now; Triton on GPU later)."""

from tandem.engine.attention.backend import AttentionBackend, get_attention_backend
from tandem.engine.attention.metadata import AttentionMetadata, PrefillSpan

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSpan", "get_attention_backend"]

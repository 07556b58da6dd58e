"""Attention backends over the paged KV cache (torch reference now; Triton on GPU later)."""

from engine.attention.backend import AttentionBackend, get_attention_backend
from engine.attention.metadata import AttentionMetadata, PrefillSpan

__all__ = ["AttentionBackend", "AttentionMetadata", "PrefillSpan", "get_attention_backend"]

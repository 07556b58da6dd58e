"""The `transformers` baseline of the engine benchmark, on the same weights and dtype.

Prefill is one forward of the whole prompt with `logits_to_keep=1` (the engine also
projects only the last row). A decode step is one forward of [B, 1] tokens whose
`DynamicCache` already holds a prompt's worth of keys and values; like the engine's
imported batch, the cache is filled directly instead of by a prefill, since attention
cost does not depend on the values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from tandem.bench.engine_measure import random_prompt
from tandem.bench.engine_timing import time_call

# transformers' default attention; "eager" would be slower and an unfair baseline.
ATTN_IMPLEMENTATION = "sdpa"


def load_hf_model(model_dir: str, dtype: torch.dtype) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
    )
    return model.eval()


def hf_prefill_timer(model: PreTrainedModel, prompt: list[int]) -> Callable[[], float]:
    """Times one forward of the whole prompt (a fresh KV cache each run)."""
    input_ids = torch.tensor([prompt])

    def run_once() -> float:
        with torch.inference_mode():
            return time_call(lambda: model(input_ids=input_ids, logits_to_keep=1))

    return run_once


class HfDecodeBatch:
    """B sequences whose cache holds `prompt_len` tokens; `step()` times one [B, 1] forward."""

    def __init__(self, model: PreTrainedModel, batch_size: int, prompt_len: int) -> None:
        self.model = model
        self.cache = _filled_cache(model, batch_size, prompt_len)
        token_ids = random_prompt(batch_size, model.config.vocab_size, seed=1)
        self.input_ids = torch.tensor(token_ids)[:, None]
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns).
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def step(self) -> float:
        kwargs = {"input_ids": self.input_ids, self.cache_kwarg: self.cache, "use_cache": True}
        with torch.inference_mode():
            return time_call(lambda: self.model(**kwargs))

    def next_context_len(self) -> int:
        """Keys the next step attends to per sequence (cached tokens plus the new one)."""
        return self.cache.get_seq_length() + 1


def _filled_cache(model: PreTrainedModel, batch_size: int, prompt_len: int) -> DynamicCache:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (batch_size, cfg.num_key_value_heads, prompt_len, head_dim)
    gen = torch.Generator().manual_seed(0)
    cache = DynamicCache(config=cfg)
    with torch.inference_mode():
        for layer_idx in range(cfg.num_hidden_layers):
            keys = torch.randn(shape, generator=gen).to(model.dtype)
            values = torch.randn(shape, generator=gen).to(model.dtype)
            cache.update(keys, values, layer_idx)
    return cache

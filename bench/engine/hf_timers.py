"""What `transformers` is timed on in the engine benchmark: the model as HF loads it, with
its default (SDPA) attention, and one forward per shape: a prompt from position 0, a
decode step over a filled `DynamicCache`, new tokens over a cached prefix."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from tandem.bench.engine.timing import time_call

# transformers' default attention; "eager" would be slower and an unfair baseline.
ATTN_IMPLEMENTATION = "sdpa"


def load_hf_model(model_dir: str, dtype: torch.dtype) -> PreTrainedModel:
    kwargs = {"dtype": dtype, "attn_implementation": ATTN_IMPLEMENTATION}
    return AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()


def hf_prefill_timer(model: PreTrainedModel, prompt: list[int]) -> Callable[[], float]:
    """Times one forward of the whole prompt (a fresh KV cache each run)."""
    input_ids = torch.tensor([prompt])

    def run_once() -> float:
        with torch.inference_mode():
            return time_call(lambda: model(input_ids=input_ids, logits_to_keep=1))

    return run_once


def hf_decode_timer(
    model: PreTrainedModel, token_ids: list[int], prompt_len: int
) -> Callable[[], float]:
    """Times one [B, 1] forward of `token_ids` (one per sequence) over a cache holding
    `prompt_len` tokens per sequence (and growing by one per call)."""
    kwargs = {
        "input_ids": torch.tensor(token_ids)[:, None], "use_cache": True,
        _cache_kwarg(model): _filled_cache(model, len(token_ids), prompt_len),
    }  # fmt: skip

    def run_once() -> float:
        with torch.inference_mode():
            return time_call(lambda: model(**kwargs))

    return run_once


def hf_prefix_hit_timer(
    model: PreTrainedModel, prefix_len: int, new_tokens: list[int]
) -> Callable[[], float]:
    """Times one [1, len(new_tokens)] forward over a cache holding `prefix_len` tokens
    (the cache rebuilt from the same tensors before each run: the forward appends to it),
    logits for the last token."""
    prefix = _random_kv(model, 1, prefix_len)
    input_ids = torch.tensor([new_tokens])
    cache_kwarg = _cache_kwarg(model)

    def run_once() -> float:
        kwargs = {
            "input_ids": input_ids, "use_cache": True, "logits_to_keep": 1,
            cache_kwarg: _cache_of(model, prefix),
        }  # fmt: skip
        with torch.inference_mode():
            return time_call(lambda: model(**kwargs))

    return run_once


# One layer's keys and values [batch, kv_heads, tokens, head_dim] (a transformers cache's).
LayerKv = tuple[torch.Tensor, torch.Tensor]


def _filled_cache(model: PreTrainedModel, batch_size: int, prompt_len: int) -> DynamicCache:
    return _cache_of(model, _random_kv(model, batch_size, prompt_len))


def _random_kv(model: PreTrainedModel, batch_size: int, num_tokens: int) -> list[LayerKv]:
    """Per layer, random keys and values [batch, kv_heads, num_tokens, head_dim]."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (batch_size, cfg.num_key_value_heads, num_tokens, head_dim)
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(shape, generator=gen).to(model.dtype),
         torch.randn(shape, generator=gen).to(model.dtype))
        for _ in range(cfg.num_hidden_layers)
    ]  # fmt: skip


def _cache_of(model: PreTrainedModel, layers: list[LayerKv]) -> DynamicCache:
    """A cache holding `layers`' keys and values (a forward appends to copies, not to them)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for layer_idx, (keys, values) in enumerate(layers):
            cache.update(keys, values, layer_idx)
    return cache


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers 5.x renamed `past_key_values` to `cache` (the old name warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

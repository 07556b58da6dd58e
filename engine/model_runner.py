"""Turns a `SchedulerOutput` into tensors, runs the model, samples next tokens.

Decodes (one query token) are laid out first so the attention backend batches them;
prefill chunks follow. Logits are computed only for rows that sample (the last token
of each sequence that reaches its end this step), never for whole prompts.
"""

from __future__ import annotations

import torch

from tandem.engine.attention import AttentionMetadata, PrefillSpan
from tandem.engine.config import EngineConfig
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.prompt_logprobs import record_prompt_logprobs
from tandem.engine.sampler import Sampler
from tandem.engine.scheduler import SampledToken, ScheduledChunk, SchedulerOutput
from tandem.engine.structured.masking import apply_grammar_masks


class ModelRunner:
    """Owns the model and the KV cache tensor of one engine."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, kv: KVCacheManager) -> None:
        cfg = config.model_config
        self.config = config
        self.model = model
        self.kv = kv
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        # One tensor for the whole cache: [layers, K/V, blocks, block_size, kv_heads, head_dim].
        self.kv_caches = torch.zeros(
            cfg.num_layers,
            2,
            kv.pool.num_blocks,  # one cache slot per pool block
            config.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=config.torch_dtype,
            device=self.device,
        )
        self.sampler = Sampler()
        self.eos_token_ids = list(cfg.eos_token_ids)

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        index = torch.tensor(block_ids, device=self.device)
        return self.kv_caches.index_select(2, index)

    def write_kv_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Inverse of `read_kv_blocks` (shapes and dtype must match)."""
        expected = (*self.kv_caches.shape[:2], len(block_ids), *self.kv_caches.shape[3:])
        if tuple(blocks.shape) != expected or blocks.dtype != self.kv_caches.dtype:
            raise ValueError(
                f"KV blocks of shape {tuple(blocks.shape)} {blocks.dtype} do not fit "
                f"{expected} {self.kv_caches.dtype}"
            )
        index = torch.tensor(block_ids, device=self.device)
        self.kv_caches.index_copy_(2, index, blocks.to(self.device))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        chunks = sorted(out.chunks, key=lambda c: c.num_new_tokens != 1)
        input_ids, positions, meta = self._prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        record_prompt_logprobs(self.model, hidden, chunks, meta.query_start_loc)
        sampling = [c for c in chunks if c.samples]
        if not sampling:
            return {}
        ends = meta.query_start_loc[1:]
        rows = [int(ends[i]) - 1 for i, c in enumerate(chunks) if c.samples]
        logits = self.model.compute_logits(hidden[rows])
        self._mask_early_stops(logits, sampling)
        apply_grammar_masks(logits, [c.request.grammar for c in sampling])
        result = self.sampler.sample(
            logits,
            [c.request.params for c in sampling],
            [c.request.generator for c in sampling],
            [c.request for c in sampling],
        )
        return {
            c.request.req_id: SampledToken(tok, lp)
            for c, tok, lp in zip(sampling, result.token_ids, result.logprobs, strict=True)
        }

    def _mask_early_stops(self, logits: torch.Tensor, sampling: list[ScheduledChunk]) -> None:
        """Forbid EOS and stop token ids while a request is below its `min_tokens`."""
        for row, chunk in enumerate(sampling):
            req = chunk.request
            if len(req.output_token_ids) >= req.params.min_tokens:
                continue
            banned = list(req.params.stop_token_ids)
            if not req.params.ignore_eos:
                banned += self.eos_token_ids
            if banned:
                logits[row, banned] = float("-inf")

    def _prepare(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        num_decodes = 0
        for chunk in chunks:
            req = chunk.request
            start = req.num_computed_tokens
            end = start + chunk.num_new_tokens
            blocks = self.kv.block_ids[req.req_id]
            token_ids += req.token_ids(start, end)
            new_positions = range(start, end)
            positions += new_positions
            slots += [
                blocks[p // block_size] * block_size + p % block_size for p in new_positions
            ]
            starts.append(starts[-1] + chunk.num_new_tokens)
            seq_lens.append(end)
            tables.append(blocks)
            num_decodes += chunk.num_new_tokens == 1
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables.to(self.device),
            slot_mapping=torch.tensor(slots, device=self.device),
            num_decodes=num_decodes,
            decode_mask=_decode_mask(seq_lens[:num_decodes], self.device),
            max_decode_len=max(seq_lens[:num_decodes], default=0),
            prefills=[
                _prefill_span(
                    starts[i],
                    seq_lens[i],
                    chunks[i].num_new_tokens,
                    block_tables[i, : -(-seq_lens[i] // block_size)],
                )
                for i in range(num_decodes, len(chunks))
            ],
        )
        for span in meta.prefills:
            span.block_table = span.block_table.to(self.device)
            if span.mask is not None:
                span.mask = span.mask.to(self.device)
        return (
            torch.tensor(token_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
        )


def _decode_mask(seq_lens: list[int], device: torch.device) -> torch.Tensor | None:
    """Key-padding mask for batched decodes; None when no padding is needed."""
    if len(seq_lens) <= 1 or min(seq_lens) == max(seq_lens):
        return None
    lens = torch.tensor(seq_lens)
    mask = torch.arange(max(seq_lens)) < lens[:, None]
    return mask[:, None, None, :].to(device)


def _prefill_span(
    query_start: int, seq_len: int, query_len: int, block_table: torch.Tensor
) -> PrefillSpan:
    context_len = seq_len - query_len
    mask = None
    if context_len:
        # Query i sits at absolute position context_len + i and sees keys 0..that position.
        rows = torch.arange(query_len)[:, None] + context_len
        mask = torch.arange(seq_len)[None, :] <= rows
    return PrefillSpan(query_start, query_len, context_len, block_table, mask)

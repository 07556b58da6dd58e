"""Turns a `SchedulerOutput` into tensors, runs the model, samples next tokens.

Decodes (one query token) are laid out first, longest context first, so the attention
backend batches them; prefill chunks follow. The step's `BatchLayout` goes to the model's
attention backend, which builds its own metadata once for all layers. Logits are
computed only for rows that sample (the last token of each sequence that reaches its
end this step), never for whole prompts.
"""

from __future__ import annotations

import torch

from tandem.engine.attention import AttentionMetadata, BatchLayout
from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.cuda_graphs import DecodeGraphs
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.prompt_logprobs import record_prompt_logprobs
from tandem.engine.request import Request
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
        self.attention_backend = model.attention_backend
        self.sampler = Sampler(cpu_argmax=self.attention_backend.loads_cpu_ops)
        self.eos_token_ids = list(cfg.eos_token_ids)
        # Decode-only steps replay CUDA graphs when the config asks for them (CUDA only;
        # a prefill-only engine never decodes).
        self.decode_graphs: DecodeGraphs | None = None
        if config.use_cuda_graphs and config.mode is not EngineMode.PREFILL_ONLY:
            self.decode_graphs = DecodeGraphs(
                model, self.kv_caches, config.max_num_seqs, config.max_model_len, self.block_size
            )
            self.decode_graphs.capture_all()

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
        # Decodes first, longest context first (the attention backend groups similar ones).
        chunks = sorted(
            out.chunks, key=lambda c: (c.num_new_tokens != 1, -c.request.num_computed_tokens)
        )
        token_ids, positions, batch = self._prepare(chunks)
        hidden = self._forward(token_ids, positions, batch)
        if any(c.request.params.prompt_logprobs for c in chunks):
            starts = torch.tensor(batch.query_start_loc)
            record_prompt_logprobs(self.model, hidden, chunks, starts)
        sampling = [c for c in chunks if c.samples]
        if not sampling:
            return {}
        ends = batch.query_start_loc[1:]
        rows = [ends[i] - 1 for i, c in enumerate(chunks) if c.samples]
        # Every row samples in an all-decode step: no row copy then.
        selected = hidden if len(rows) == hidden.shape[0] else hidden[rows]
        logits = self.model.compute_logits(selected)
        apply_grammar_masks(logits, [c.request.grammar for c in sampling])
        result = self.sampler.sample(
            logits,
            [c.request.params for c in sampling],
            [c.request.draw_seed for c in sampling],
            [c.request for c in sampling],
            banned=[self._early_stops(c.request) for c in sampling],
        )
        return {
            c.request.req_id: SampledToken(tok, lp, top)
            for c, tok, lp, top in zip(
                sampling, result.token_ids, result.logprobs, result.top_logprobs, strict=True
            )
        }

    def _forward(
        self, token_ids: list[int], positions: list[int], batch: BatchLayout
    ) -> torch.Tensor:
        """Final hidden states: a graph replay for a decode-only step that fits a bucket,
        the CPU stack op for a step it covers (it takes the lists), else the model run
        eagerly."""
        graphs = self.decode_graphs
        bucket = graphs.bucket_for(batch) if graphs is not None else None
        if graphs is not None and bucket is not None:
            return graphs.run(bucket, self._on_device(token_ids), self._on_device(positions), batch)
        stack = self.model.cpu_stack
        if stack is not None and stack.covers(batch):
            return stack(token_ids, positions, self.kv_caches, batch)
        meta: AttentionMetadata = self.attention_backend.build_metadata(batch)
        return self.model(
            self._on_device(token_ids), self._on_device(positions), self.kv_caches, meta
        )

    def _on_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _early_stops(self, req: Request) -> list[int]:
        """The tokens that would stop `req` below its `min_tokens` (EOS, its stop token
        ids), which it may not draw yet; none once it has min_tokens output tokens."""
        if len(req.output_token_ids) >= req.params.min_tokens:
            return []
        banned = list(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            banned += self.eos_token_ids
        return banned

    def _prepare(self, chunks: list[ScheduledChunk]) -> tuple[list[int], list[int], BatchLayout]:
        """The step's token ids, positions and layout, as host lists."""
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        num_decodes = 0
        block_ids = self.kv.block_ids
        for chunk in chunks:
            req = chunk.request
            start = req.num_computed_tokens
            num_new = chunk.num_new_tokens
            end = start + num_new
            blocks = block_ids[req.req_id]
            if num_new == 1:  # a decode: no ranges or list slices to build
                token_ids.append(req.token_id(start))
                positions.append(start)
                slots.append(blocks[start // block_size] * block_size + start % block_size)
                num_decodes += 1
            else:
                token_ids += req.token_ids(start, end)
                new_positions = range(start, end)
                positions += new_positions
                slots += [
                    blocks[p // block_size] * block_size + p % block_size for p in new_positions
                ]
            starts.append(starts[-1] + num_new)
            seq_lens.append(end)
            tables.append(blocks)
        batch = BatchLayout(
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=tables,
            slots=slots,
            num_decodes=num_decodes,
            block_size=block_size,
            device=self.device,
        )
        return token_ids, positions, batch

"""CUDA graphs for decode-only steps at bucketed batch sizes (the model runner's fast path).

A decode step launches hundreds of small kernels; on a GPU their launch overhead, not
the math, bounds small batches. At start-up `DecodeGraphs` captures the model's forward
once per batch-size bucket (1, 2, 4, 8, then every 16 up to `max_num_seqs`, at most
`MAX_GRAPH_BATCH`) over static input buffers: token ids, positions, slot mapping,
query start offsets, sequence lengths and block tables (the Triton backend's metadata,
which its kernels read on the device, so a replay needs no host-side change). A step
whose sequences are all decodes copies its inputs into the buffers, pads the batch to
the next bucket and replays; prefill or mixed steps, and batches past the largest
bucket, run eagerly.

Padding rows are harmless: their slot is `PAD_SLOT` (the K/V write kernel skips
negative slots), their one key is block 0's first position, and their outputs are
never read. The split-K plan of the decode kernel is fixed per graph for
`max_model_len` (splits past a sequence's end are empty and weigh nothing).

`capture=False` runs the same static-buffer path eagerly: CPU tests (Triton's
interpreter) check the padding and metadata that way; only the capture itself needs a
GPU.
"""

from __future__ import annotations

import bisect
import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tandem.engine.attention.metadata import BatchLayout

if TYPE_CHECKING:
    from tandem.engine.attention.triton_backend import TritonAttentionMetadata
    from tandem.engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Slot of a padding row: the K/V write kernel writes nothing for negative slots.
PAD_SLOT = -1
# Largest captured batch; larger decode batches run eagerly (their launch overhead is
# small next to their math, and every graph holds its activations' memory).
MAX_GRAPH_BATCH = 256


class CudaGraphMode(enum.StrEnum):
    """`--cuda-graphs`: auto (on where it can run), on (an error where it cannot), off."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


def resolve_cuda_graphs(mode: str, device: str, attention_backend: str) -> bool:
    """Whether decode steps replay CUDA graphs, for a resolved attention backend;
    ValueError when `mode` is unknown or `on` cannot run here."""
    choices = ", ".join(m.value for m in CudaGraphMode)
    try:
        chosen = CudaGraphMode(mode)
    except ValueError:
        raise ValueError(f"cuda_graphs must be one of {choices}, got {mode!r}") from None
    on_cuda = device.startswith("cuda")
    if chosen is CudaGraphMode.ON:
        if not on_cuda:
            raise ValueError(f"cuda_graphs on needs a CUDA device; the engine runs on {device}")
        if attention_backend != "triton":
            raise ValueError(
                "cuda_graphs on needs attention_backend triton (its metadata lives in "
                f"static device tensors); got {attention_backend}"
            )
    if chosen is CudaGraphMode.OFF:
        return False
    return on_cuda and attention_backend == "triton"


def graph_batch_sizes(max_num_seqs: int, max_graph_batch: int = MAX_GRAPH_BATCH) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then multiples of 16, up to (and always
    including) min(max_num_seqs, max_graph_batch)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, max_graph_batch)
    sizes = [s for s in (1, 2, 4, 8, *range(16, top + 1, 16)) if s <= top]
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def choose_bucket(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` sequences, None past the largest."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) and num_seqs >= 1 else None


@dataclass
class PaddedDecode:
    """A decode-only step's metadata padded to its bucket (host tensors, int32)."""

    # [bucket + 1]: one query token per row, so 0, 1, ..., bucket.
    query_start_loc: torch.Tensor
    # [bucket]: the real lengths, then 1 for each padding row.
    seq_lens: torch.Tensor
    # [bucket, width]: the real tables padded with block 0, then rows of block 0.
    block_tables: torch.Tensor


def pad_decode_metadata(
    seq_lens: list[int], block_tables: list[list[int]], bucket: int, width: int
) -> PaddedDecode:
    """ValueError when the step does not fit the bucket or a table is wider than `width`."""
    num_seqs = len(seq_lens)
    if not 1 <= num_seqs <= bucket or len(block_tables) != num_seqs:
        raise ValueError(f"{num_seqs} sequences do not fit a batch of {bucket}")
    tables = torch.zeros(bucket, width, dtype=torch.int32)
    for row, table in enumerate(block_tables):
        if len(table) > width:
            raise ValueError(f"a block table of {len(table)} blocks exceeds width {width}")
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return PaddedDecode(
        query_start_loc=torch.arange(bucket + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens + [1] * (bucket - num_seqs), dtype=torch.int32),
        block_tables=tables,
    )


def is_graphable(batch: BatchLayout) -> bool:
    """A step the graphs can run: decodes only (one query token per sequence)."""
    return batch.num_seqs > 0 and batch.num_decodes == batch.num_seqs


class DecodeGraphs:
    """Static buffers and one captured graph per bucket, for one model runner."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: torch.Tensor,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        *,
        capture: bool = True,
        max_graph_batch: int = MAX_GRAPH_BATCH,
    ) -> None:
        """`model.attention_backend` must be the Triton backend. `capture=False` keeps
        the static-buffer path eager (CPU tests)."""
        from tandem.engine.attention.triton_backend import TritonAttentionBackend

        backend = model.attention_backend
        if not isinstance(backend, TritonAttentionBackend):
            raise ValueError(f"CUDA graphs need the triton attention backend, got {backend.name}")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs, max_graph_batch)
        self.width = -(-max_model_len // block_size)
        self.num_splits, self.split_len = backend.split_plan(max_model_len)
        self.device = kv_caches.device
        self.capture = capture
        top = self.sizes[-1]
        hidden = model.config.hidden_size
        dtype = kv_caches.dtype
        on = self.device
        self.input_ids = torch.zeros(top, dtype=torch.long, device=on)
        self.positions = torch.zeros(top, dtype=torch.long, device=on)
        self.slot_mapping = torch.full((top,), PAD_SLOT, dtype=torch.long, device=on)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=on)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=on)
        self.block_tables = torch.zeros(top, self.width, dtype=torch.int32, device=on)
        self.hidden = torch.zeros(top, hidden, dtype=dtype, device=on)
        self._graphs: dict[int, Any] = {}  # bucket -> torch.cuda.CUDAGraph
        # Decode steps run through the static buffers (replayed or, uncaptured, eager).
        self.num_runs = 0

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warm up and capture every bucket, largest first (smaller graphs reuse the
        shared memory pool). A no-op with `capture=False`."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles the Triton kernels for this shape
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batches %s", self.sizes)

    def bucket_for(self, batch: BatchLayout) -> int | None:
        """The bucket that runs `batch`, or None when it runs eagerly."""
        if not is_graphable(batch) or max(len(t) for t in batch.block_tables) > self.width:
            return None
        return choose_bucket(batch.num_seqs, self.sizes)

    def run(
        self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, batch: BatchLayout
    ) -> torch.Tensor:
        """Final hidden states [num_seqs, hidden] of a decode-only step; a view of the
        static output, valid until the next `run`."""
        num_seqs = batch.num_seqs
        padded = pad_decode_metadata(batch.seq_lens, batch.block_tables, bucket, self.width)
        self.input_ids[:num_seqs].copy_(input_ids)
        self.input_ids[num_seqs:bucket].zero_()
        self.positions[:num_seqs].copy_(positions)
        self.positions[num_seqs:bucket].zero_()
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping)
        self.slot_mapping[num_seqs:bucket].fill_(PAD_SLOT)
        self.seq_lens[:bucket].copy_(padded.seq_lens)
        self.block_tables[:bucket].copy_(padded.block_tables)
        self.num_runs += 1
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._forward(bucket)
        return self.hidden[:num_seqs]

    def _forward(self, bucket: int) -> None:
        """The model over the first `bucket` rows of the static buffers, into `hidden`."""
        meta = self._metadata(bucket)
        out = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
        self.hidden[:bucket].copy_(out)

    def _metadata(self, bucket: int) -> TritonAttentionMetadata:
        from tandem.engine.attention.triton_backend import TritonAttentionMetadata

        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decodes=bucket,
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            num_prefills=0,
            max_prefill_query_len=0,
            num_splits=self.num_splits,
            split_len=self.split_len,
        )

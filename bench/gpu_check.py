"""`tandem-bench gpu-check`: one prepared run on one GPU (about 8 minutes on an H200).

1. Token equality on the device vs `transformers` on the `tiny` preset (float32): the
   engine with decode CUDA graphs on and off, and a served 1 prefill + 1 decode cluster
   whose workers share the GPU and move KV by `cuda_ipc` (bench/gpu_serving.py).
2. An 8B-shaped (Llama 3 8B) random-weight bf16 checkpoint, written to `--workdir`; its
   decode step at batch 1/32/128 against the HBM roofline (weights + KV read once per
   step at the measured copy bandwidth), and its prefill of 2,048 tokens as MFU
   (model FLOPs / time / the measured bf16 GEMM peak).
3. KV transfer of 2,048 tokens' KV, GB/s: a tcp pull served from the GPU cache
   (gathered slab by slab on the device), and `cuda_ipc` pulls between two processes
   (checked bit for bit).
It writes the "## GPU check" section of `--out`. `--dry-run` runs every step on the CPU
with tiny shapes (what the test suite does); its numbers mean nothing. There graphs
are `auto` (off on a CPU) and the cluster and the two-process pulls use
`--kv-backend auto` (tcp on a CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.bench import gpu_serving
from tandem.bench.engine import measure
from tandem.bench.report import publish, render_table
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import Engine
from tandem.engine.model_maker import make_model
from tandem.kv_transfer import CacheBlocks, KvHandle, KvLayout, KvTransferClient, KvTransferService

logger = logging.getLogger(__name__)
SECTION_HEADING = "## GPU check"


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped model with random weights."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def weights(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor names (Hugging Face Llama) and shapes."""
        kv = self.num_kv_heads * self.head_dim
        names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, self.hidden)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            names |= {
                p + "self_attn.q_proj.weight": (self.hidden, self.hidden),
                p + "self_attn.k_proj.weight": (kv, self.hidden),
                p + "self_attn.v_proj.weight": (kv, self.hidden),
                p + "self_attn.o_proj.weight": (self.hidden, self.hidden),
                p + "mlp.gate_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.up_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.down_proj.weight": (self.hidden, self.intermediate),
                p + "input_layernorm.weight": (self.hidden,),
                p + "post_attention_layernorm.weight": (self.hidden,),
            }
        return names | {
            "model.norm.weight": (self.hidden,),
            "lm_head.weight": (self.vocab, self.hidden),
        }


LLAMA3_8B = Shape(32, 4096, 32, 8, 14336, 128256)
DRY_RUN = Shape(2, 128, 4, 2, 256, 2048)


def write_random_checkpoint(
    out: Path, shape: Shape, max_len: int, device: str, tokenizer_dir: Path
) -> Path:
    """config.json, tokenizer (`tokenizer_dir`'s, padded with reserved tokens to the
    vocabulary: training a BPE of 128k ids takes minutes) and bf16 random weights (one
    shard per layer, drawn on `device`), loadable by `Engine`."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": shape.vocab,
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads, "rms_norm_eps": 1e-5,
        "max_position_embeddings": max_len, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), model_max_length=max_len)
    reserved = [f"<|reserved_{i}|>" for i in range(shape.vocab - len(tokenizer))]
    tokenizer.add_tokens(reserved, special_tokens=True)
    tokenizer.save_pretrained(str(out))
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    for i, (name, dims) in enumerate(shape.weights().items()):
        if len(dims) == 1:
            shard[name] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            std = dims[1] ** -0.5
            shard[name] = (torch.randn(dims, generator=gen, device=device) * std).bfloat16().cpu()
        if name.endswith("post_attention_layernorm.weight") or i == len(shape.weights()) - 1:
            save_file(shard, str(out / f"model-{i:05d}.safetensors"))
            shard = {}
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), best of 5."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def gemm_peak(device: str, size: int) -> float:
    """FLOP/s of a square bf16 matmul, best of 5."""
    a = torch.randn(size, size, device=device).bfloat16()
    b = torch.randn(size, size, device=device).bfloat16()
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


@dataclass
class EqualityResult:
    """Token equality vs transformers on the tiny preset."""

    graphs_on: gpu_serving.Equality
    graphs_off: gpu_serving.Equality
    disagg: gpu_serving.Equality
    # What "graphs on" and the cluster's KV backend were (the dry run cannot have them).
    graph_mode: str
    kv_backend: str

    @property
    def ok(self) -> bool:
        return self.graphs_on.ok and self.graphs_off.ok and self.disagg.ok


def check_equality(model_dir: Path, device: str, max_tokens: int, log_dir: Path) -> EqualityResult:
    """The engine with graphs on and off, and a 1P+1D cluster over cuda_ipc, vs transformers."""
    on_cuda = device.startswith("cuda")
    graph_mode, kv_backend = ("on", "cuda_ipc") if on_cuda else ("auto", "auto")
    want = gpu_serving.hf_greedy(model_dir, device, max_tokens)
    return EqualityResult(
        graphs_on=gpu_serving.engine_equality(model_dir, device, max_tokens, graph_mode, want),
        graphs_off=gpu_serving.engine_equality(model_dir, device, max_tokens, "off", want),
        disagg=gpu_serving.disagg_equality(
            model_dir, "cuda" if on_cuda else "cpu", kv_backend, max_tokens, log_dir, want
        ),
        graph_mode=graph_mode,
        kv_backend=kv_backend,
    )


@dataclass
class Plan:
    device: str
    shape: Shape
    batch_sizes: tuple[int, ...]
    prefill_len: int
    prompt_len: int  # context of each decode sequence
    num_steps: int
    copy_bytes: int
    gemm_size: int


@dataclass
class ModelResult:
    weight_bytes: int
    bandwidth: float  # bytes/s
    decode: list[tuple[int, float, float]]  # (batch, step s, roofline s)
    prefill_s: float
    mfu: float
    peak: float  # FLOP/s


def measure_model(model_dir: Path, plan: Plan) -> ModelResult:
    shape, device = plan.shape, plan.device
    max_len = max(plan.prefill_len, plan.prompt_len + plan.num_steps + 8) + 1
    blocks_per_seq = -(-max_len // 16)
    max_batch = max(plan.batch_sizes)
    config = EngineConfig(
        model=str(model_dir), dtype="bfloat16", device=device,
        num_blocks=max_batch * blocks_per_seq, max_num_seqs=max_batch,
        max_num_batched_tokens=max(plan.prefill_len, max_batch), max_model_len=max_len,
        enable_prefix_caching=False,
    )  # fmt: skip
    engine = Engine(config)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kv_bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    bandwidth = copy_bandwidth(device, plan.copy_bytes)
    decode = []
    for batch in plan.batch_sizes:
        with measure.decode_batch(engine, batch, plan.prompt_len, plan.num_steps + 4) as running:
            for _ in range(2):
                running.step()  # warm-up
            times = [running.step() for _ in range(plan.num_steps)]
        step_s = statistics.median(times)
        kv_read = batch * (plan.prompt_len + 3 + plan.num_steps // 2) * kv_bytes_per_token
        floor_s = (weight_bytes + kv_read) / bandwidth
        decode.append((batch, step_s, floor_s))
    prompt = measure.random_prompt(plan.prefill_len, shape.vocab, seed=1)
    timer = measure.prefill_timer(engine, prompt)
    timer()  # warm-up
    prefill_s = min(timer() for _ in range(3))
    matmul_params = weight_bytes / 2 - shape.vocab * shape.hidden  # the embedding is a lookup
    attention = 2 * shape.num_layers * plan.prefill_len**2 * shape.hidden  # causal QK^T + PV
    flops = 2 * matmul_params * plan.prefill_len + attention
    peak = gemm_peak(device, plan.gemm_size)
    return ModelResult(weight_bytes, bandwidth, decode, prefill_s, flops / prefill_s / peak, peak)


async def kv_transfer_gbps(shape: Shape, device: str, num_tokens: int) -> float:
    """GB/s of tcp pulls of `num_tokens` tokens' KV served from a cache on `device`."""
    layout = KvLayout(
        "gpu-check", "bfloat16", 16, shape.num_layers, shape.num_kv_heads, shape.head_dim
    )
    num_blocks = -(-num_tokens // 16)
    cache = torch.randn(layout.block_shape(num_blocks + 8), device=device).bfloat16()
    ids = torch.randperm(num_blocks + 8)[:num_blocks].tolist()
    service = KvTransferService(layout, lambda request_id: CacheBlocks(cache, ids))
    import grpc

    from tandem.proto.tandem.worker.v1 import worker_pb2_grpc

    server = grpc.aio.server()
    worker_pb2_grpc.add_KvTransferServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = KvTransferClient(layout, "gpu-check-decode")
    handle = KvHandle("p", f"127.0.0.1:{port}", "r", ids, num_tokens, layout.fingerprint())
    try:
        await client.pull(handle)  # warm-up: channel and buffers
        times = await gpu_serving.timed_pulls(client, handle)
    finally:
        await client.close()
        await service.stop()
        await server.stop(None)
    return layout.block_nbytes(num_blocks) / statistics.median(times) / 1e9


@dataclass
class KvResult:
    tcp_gbps: float
    ipc_gbps: float  # the two-process pulls (cuda_ipc; tcp in the dry run)
    ipc_exact: bool


def render(
    args: argparse.Namespace, plan: Plan, equal: EqualityResult, model: ModelResult, kv: KvResult
) -> str:
    decode = model.decode
    device_name = torch.cuda.get_device_name() if plan.device.startswith("cuda") else "CPU"
    dry = " (dry run on the CPU, tiny shapes: numbers mean nothing)" if args.dry_run else ""
    rows = [[str(b), f"{s * 1e3:.2f}", f"{f * 1e3:.2f}", f"{s / f:.2f}x"] for b, s, f in decode]
    on, off, pair = equal.graphs_on, equal.graphs_off, equal.disagg
    exact = "bit-exact" if kv.ipc_exact else "**not bit-exact**"
    lines = [
        f"`{args.command}`{dry}",
        "",
        f"Device {device_name}; torch {torch.__version__}. Token equality vs transformers "
        f"(tiny preset, float32): engine with CUDA graphs `{equal.graph_mode}` "
        f"**{on.num_equal}/{on.num_prompts} prompts equal** ({on.num_graph_runs} decode steps "
        f"through the graphs), graphs off **{off.num_equal}/{off.num_prompts}**, 1P+1D with "
        f"`--kv-backend {equal.kv_backend}` **{pair.num_equal}/{pair.num_prompts}**. Random "
        f"{plan.shape} in bfloat16, {model.weight_bytes / 1e9:.2f} GB of weights; "
        f"measured copy bandwidth {model.bandwidth / 1e12:.2f} TB/s, bf16 GEMM peak "
        f"{model.peak / 1e12:.1f} TFLOP/s.",
        "",
        render_table(["decode batch", "step ms", "roofline ms", "step / roofline"], rows),
        "",
        f"Prefill of {plan.prefill_len:,} tokens: {model.prefill_s * 1e3:.1f} ms, "
        f"**MFU {model.mfu:.0%}**. KV transfer of {plan.prefill_len:,} tokens: tcp served "
        f"from the device cache **{kv.tcp_gbps:.2f} GB/s**; between two processes over "
        f"`{equal.kv_backend}` **{kv.ipc_gbps:.2f} GB/s** ({exact}).",
    ]  # fmt: skip
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if not args.dry_run and not torch.cuda.is_available():
        print("tandem-bench gpu-check: no CUDA device (use --dry-run to exercise it on the CPU)")
        return 2
    plan = (
        Plan("cpu", DRY_RUN, (1, 2), 64, 16, 3, 1 << 22, 128)
        if args.dry_run
        else Plan("cuda", LLAMA3_8B, (1, 32, 128), 2048, 512, 20, 1 << 31, 8192)
    )
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        workdir = Path(tmp)
        tiny = make_model("tiny", workdir / "tandem-tiny", seed=0)
        max_tokens = 8 if args.dry_run else 32
        equal = check_equality(tiny, plan.device, max_tokens, workdir / "logs")
        logger.info("equality: %s", equal)
        max_len = max(plan.prefill_len, plan.prompt_len + plan.num_steps + 8) + 1
        model_dir = write_random_checkpoint(
            workdir / "random", plan.shape, max_len, plan.device, tiny
        )
        model = measure_model(model_dir, plan)
    shape = plan.shape
    layout = KvLayout("gpu-check", "bfloat16", 16, shape.num_layers, shape.num_kv_heads,
                      shape.head_dim)  # fmt: skip
    ipc_gbps, ipc_exact = gpu_serving.two_process_kv_gbps(
        layout, plan.prefill_len, plan.device, equal.kv_backend
    )
    kv = KvResult(
        asyncio.run(kv_transfer_gbps(plan.shape, plan.device, plan.prefill_len)),
        ipc_gbps,
        ipc_exact,
    )
    publish(args.out, SECTION_HEADING, [render(args, plan, equal, model, kv)])
    return 0 if equal.ok and ipc_exact else 1

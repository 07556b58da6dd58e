"""GPU check: run on a CUDA machine (`python -m tandem.bench.gpu.check --model DIR`)."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

import torch

MAX_TOKENS = 16


def _prompts(vocab: int, lens: tuple[int, ...], seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in lens]


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to("cuda").eval()  # type: ignore[arg-type]  # transformers wraps to()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                do_sample=False, pad_token_id=2,
            )  # fmt: skip
            out.append(gen[0, len(prompt) :].tolist())
    del model
    torch.cuda.empty_cache()
    return out


def check_engine(model_dir: str, prompts: list[list[int]], expected: list[list[int]]) -> bool:
    from tandem.engine.config import EngineConfig
    from tandem.engine.generate import generate
    from tandem.engine.llm_engine import Engine
    from tandem.engine.sampling_params import SamplingParams

    config = EngineConfig(model=model_dir, device="cuda", dtype="float32", max_model_len=2048)
    engine = Engine(config)
    outputs = generate(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    ok = [o.token_ids for o in outputs] == expected and engine.is_idle()
    print(f"engine on CUDA equals transformers: {ok}")
    return ok


def check_cluster(model_dir: str, prompts: list[list[int]], expected: list[list[int]]) -> bool:
    """`tandem serve --device cuda` (1P+1D) through the harness; greedy tokens over gRPC.
    `tandem serve` has no dtype flag: the engine's "auto" is the checkpoint's (float32)."""
    from tandem.bench.harness import free_port, running, tandem_spec
    from tandem.bench.loadgen.clients import ClientConfig, GrpcClient
    from tandem.bench.loadgen.workloads import RequestSpec

    kv_backend = "nccl" if torch.cuda.device_count() >= 2 else "tcp"
    flags: tuple[str, ...] = ("--prefill", "1", "--decode", "1", "--device", "cuda")
    flags += ("--kv-backend", kv_backend)
    flags += ("--max-model-len", "2048")
    spec = tandem_spec("gpu-check", model_dir, free_port(), free_port(), flags)

    async def generate() -> list[list[int]]:
        client = GrpcClient(ClientConfig(spec.grpc_target or "", request_timeout_s=120.0))
        await client.start()
        try:
            # EOS ends a request as it ends `transformers`' generate.
            specs = [RequestSpec(f"gpu-{i}", tuple(p), MAX_TOKENS, ignore_eos=False)
                     for i, p in enumerate(prompts)]  # fmt: skip
            traces = await asyncio.gather(*(client.stream(s) for s in specs))
        finally:
            await client.close()
        failed = [t.error for t in traces if t.error]
        if failed:
            raise RuntimeError(f"requests failed: {failed}")
        return [t.token_ids for t in traces]

    with running([spec], Path("bench/results/gpu-logs")):
        got = asyncio.run(asyncio.wait_for(generate(), timeout=600))
    ok = got == expected
    print(f"1P+1D tandem serve on CUDA (kv backend {kv_backend}) equals transformers: {ok}")
    if kv_backend == "tcp":
        print("NCCL transfer: skipped (one GPU; NCCL needs a device per rank)")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tandem-small")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    from tandem.engine.config import ModelConfig

    vocab = ModelConfig.from_model_dir(args.model).vocab_size
    prompts = _prompts(vocab, (1, 7, 33, 100, 257, 511, 800, 1500))
    expected = _hf_greedy(args.model, prompts)
    results = [
        check_engine(args.model, prompts, expected),
        check_cluster(args.model, prompts, expected),
    ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())

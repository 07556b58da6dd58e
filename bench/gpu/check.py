"""GPU check: run on a CUDA machine (`python -m tandem.bench.gpu.check --model DIR`).

1. The engine on CUDA (fp32) equals `transformers` greedy on CUDA, token for token.
2. NCCL KV transfer between two worker processes: needs two GPUs, because NCCL
   refuses two ranks of one communicator on the same device; with one GPU this part
   reports that and is skipped.
3. The full 1 prefill + 1 decode cluster on CUDA through Ray (bundles of half a GPU
   when only one GPU exists; KV over NCCL with two GPUs, else TCP staging through
   host memory), 8 concurrent streams token-equal to `transformers`.
Exits non-zero on any mismatch. Prints one line per check.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

import torch

MAX_TOKENS = 16


def _prompts(vocab: int, lens: tuple[int, ...], seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in lens]


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
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


def check_engine(model_dir: str, prompts, expected) -> bool:
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


def check_cluster(model_dir: str, prompts, expected) -> bool:
    from tandem.cluster.launcher import ClusterConfig, LocalCluster
    from tests.cluster.client import assert_workers_idle, generate_tokens

    two_gpus = torch.cuda.device_count() >= 2
    config = ClusterConfig(
        model_dir=model_dir,
        device="cuda",
        kv_backend="nccl" if two_gpus else "tcp",
        gpus_per_worker=1.0 if two_gpus else 0.5,
        grpc_port=0,
        http_port=0,
        engine_overrides={"dtype": "float32", "max_model_len": 2048},
    )

    async def run() -> bool:
        cluster = LocalCluster(config)
        try:
            await cluster.start()
            got = await generate_tokens(cluster.router.grpc_endpoint, prompts, MAX_TOKENS)
            workers = [(w.endpoint, w.role) for w in cluster.workers]
            await assert_workers_idle(workers, max_channels=1)
            return got == expected
        finally:
            await cluster.stop()

    ok = asyncio.run(run())
    print(f"1P+1D cluster on CUDA (kv backend {config.kv_backend}) equals transformers: {ok}")
    if not two_gpus:
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

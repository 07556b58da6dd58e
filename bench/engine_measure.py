"""Timers on Tandem's own engine: the prefill step, decode steps, the bare matmul floor.

Each timer is a callable returning the seconds of one measured run, so the benchmark
can interleave it with the `transformers` timer of the same row. Everything goes
through the public engine API (`add_request` / `step` / `abort`). Decode batches enter
through the decode-side KV import (`reserve_import` + `commit_import`, what a decode
worker does with a remote prefill), so all B sequences decode from the first step
without minutes of prefilling B × 128 tokens in bf16; attention cost does not depend
on the cached values.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from tandem.bench.engine_timing import OpProfile, profile_self_times, time_call
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import Engine
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams

# Ids 0-4 are the dummy tokenizer's special tokens; prompts stay clear of them.
_FIRST_PLAIN_TOKEN = 5
_BLOCK_SIZE = 16


def random_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(_FIRST_PLAIN_TOKEN, vocab_size) for _ in range(num_tokens)]


def build_engine(
    model_dir: str,
    dtype: str,
    num_threads: int,
    prefill_len: int,
    max_batch_size: int,
    decode_seq_len: int,
) -> Engine:
    """An engine sized for the benchmark: prefix caching off, one-step prefill of `prefill_len`."""
    blocks_per_seq = -(-decode_seq_len // _BLOCK_SIZE)
    num_blocks = max(max_batch_size * blocks_per_seq, -(-(prefill_len + 1) // _BLOCK_SIZE))
    config = EngineConfig(
        model=model_dir,
        dtype=dtype,
        num_threads=num_threads,
        block_size=_BLOCK_SIZE,
        num_blocks=num_blocks,
        max_num_seqs=max_batch_size,
        max_num_batched_tokens=max(prefill_len, max_batch_size),
        max_model_len=max(prefill_len, decode_seq_len) + 1,
        enable_prefix_caching=False,
    )
    return Engine(config)


def _expect_tokens(outputs: list[RequestOutput], num_expected: int, what: str) -> None:
    if len(outputs) != num_expected:
        raise RuntimeError(f"{what} step produced {len(outputs)} tokens, expected {num_expected}")


def expect_idle(engine: Engine) -> None:
    if not engine.is_idle():
        raise RuntimeError("engine still holds requests or blocks after a measurement")


def prefill_timer(engine: Engine, prompt: list[int]) -> Callable[[], float]:
    """Times the one step that prefills `prompt` and samples its first token.

    Every call adds a fresh request (max_tokens=1, so it finishes in that step).
    """
    counter = itertools.count()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run_once() -> float:
        req_id = f"prefill-{next(counter)}"
        engine.add_request(req_id, prompt, params)
        elapsed = time_call(lambda: _expect_tokens(engine.step(), 1, "prefill"))
        if engine.has_unfinished_requests():
            engine.abort(req_id)
        return elapsed

    return run_once


class DecodeBatch:
    """A running batch of imported requests; `step()` times one engine step of it."""

    def __init__(self, engine: Engine, batch_size: int) -> None:
        self.engine = engine
        self.batch_size = batch_size

    def step(self) -> float:
        return time_call(lambda: _expect_tokens(self.engine.step(), self.batch_size, "decode"))

    def next_context_len(self) -> int:
        """Keys the next step attends to per sequence (its tokens so far)."""
        return max(req.num_tokens for req in self.engine.scheduler.running)


@contextmanager
def decode_batch(
    engine: Engine, batch_size: int, prompt_len: int, max_tokens: int
) -> Iterator[DecodeBatch]:
    """`batch_size` requests decoding from their first token; aborted on exit."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req_ids: list[str] = []
    try:
        for i in range(batch_size):
            req_id = f"decode-b{batch_size}-{i}"
            prompt = random_prompt(prompt_len, vocab, seed=i)
            if engine.reserve_import(req_id, prompt, prompt[0], params) is None:
                raise RuntimeError(f"KV pool too small for a decode batch of {batch_size}")
            req_ids.append(req_id)
            engine.commit_import(req_id)
        yield DecodeBatch(engine, batch_size)
    finally:
        for req_id in req_ids:
            engine.abort(req_id)
    expect_idle(engine)


def profile_prefill(engine: Engine, prompt: list[int]) -> OpProfile:
    """One prefill step under the profiler (after one unprofiled warm-up)."""
    run_once = prefill_timer(engine, prompt)
    run_once()
    result = profile_self_times(run_once)
    expect_idle(engine)
    return result


def profile_decode(engine: Engine, batch_size: int, prompt_len: int, num_steps: int) -> OpProfile:
    """`num_steps` decode steps under the profiler (after one unprofiled warm-up step)."""
    with decode_batch(engine, batch_size, prompt_len, num_steps + 2) as batch:
        batch.step()
        return profile_self_times(lambda: [batch.step() for _ in range(num_steps)])


def model_weights(model: LlamaForCausalLM) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(every layer's qkv, o, gate_up, down weight in model order, lm_head weight)."""
    layer_weights = [
        weight
        for layer in model.layers
        for weight in (
            layer.self_attn.qkv_proj.weight,
            layer.self_attn.o_proj.weight,
            layer.mlp.gate_up_proj.weight,
            layer.mlp.down_proj.weight,
        )
    ]
    return layer_weights, model.lm_head.weight


def matmul_floor_timer(
    model: LlamaForCausalLM, num_rows: int, num_logit_rows: int
) -> Callable[[], float]:
    """Times one pass of the model's weight matmuls alone, in model order."""
    layer_weights, lm_head = model_weights(model)
    dtype = lm_head.dtype
    gen = torch.Generator().manual_seed(0)
    inputs = {
        w.shape[1]: torch.randn(num_rows, w.shape[1], generator=gen).to(dtype)
        for w in layer_weights
    }
    head_input = torch.randn(num_logit_rows, lm_head.shape[1], generator=gen).to(dtype)

    def one_pass() -> None:
        for weight in layer_weights:
            F.linear(inputs[weight.shape[1]], weight)
        F.linear(head_input, lm_head)

    def run_once() -> float:
        with torch.inference_mode():
            return time_call(one_pass)

    return run_once

"""The prompts of one OpenAI request as one stream of chunks.

A completions request may batch prompts (`prompt` as a list of them, as vLLM accepts).
Each prompt runs as a request of its own through `RequestFlow` (its own placement,
admission and `n` sequences), all at once; their chunks are merged as they come, choice
`index` = prompt index × n + the sequence's index. Usage is the sum over the prompts:
each chunk that carries usage carries the sum so far, so the last one is the total.
The first prompt to fail fails the request; closing the stream cancels every prompt's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Iterable

from tandem.engine.request import FinishReason
from tandem.router.chunk_stream import ClosableChunks, MergedChunks
from tandem.router.generation_chunk import GenerationChunk, Usage
from tandem.router.openai.protocol import GenerationRequest
from tandem.router.request_flow import RequestFlow


def generate_prompts(
    flow: RequestFlow, req_id: str, generations: list[GenerationRequest]
) -> ClosableChunks:
    """The chunks of every prompt in `generations` (all with the same `n`): a single
    prompt's own stream under `req_id`, a batch's merged (prompt p under `{req_id}-{p}`).
    The caller closes it."""
    n = generations[0].extras.n
    if len(generations) == 1:
        one = generations[0]
        chunks: ClosableChunks = flow.generate(req_id, one.prompt_ids, one.params, one.slo, n=n)
    else:
        chunks = _batch_chunks(flow, req_id, generations, n)
    return _prompts_only(chunks) if generations[0].echo_only else chunks


async def _prompts_only(chunks: ClosableChunks) -> AsyncGenerator[GenerationChunk, None]:
    """Echo without generation (`GenerationRequest.echo_only`): each sequence's one
    generated token left out; it ends for `length` (0 tokens asked), its prompt scored
    if asked (the response builder echoes the prompt)."""
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            usage = chunk.usage and dataclasses.replace(chunk.usage, completion_tokens=0)
            ended = FinishReason.LENGTH if chunk.finish_reason is not None else None
            yield dataclasses.replace(
                chunk, token_ids=[], text="", logprobs=[], top_logprobs=[], usage=usage,
                finish_reason=ended, stop_reason=None,
            )  # fmt: skip


async def _batch_chunks(
    flow: RequestFlow, req_id: str, generations: list[GenerationRequest], n: int
) -> AsyncGenerator[GenerationChunk, None]:
    merged = MergedChunks()
    usages: dict[int, Usage] = {}
    try:
        for p, generation in enumerate(generations):
            chunks = flow.generate(
                f"{req_id}-{p}", generation.prompt_ids, generation.params, generation.slo, n=n
            )
            merged.start(chunks, first_index=p * n)
        async with contextlib.aclosing(merged.chunks()) as merged_chunks:
            async for chunk in merged_chunks:
                if chunk.usage is not None:
                    usages[chunk.index // n] = chunk.usage
                    chunk = dataclasses.replace(chunk, usage=_total(usages.values()))
                yield chunk
    finally:
        await merged.close()


def _total(usages: Iterable[Usage]) -> Usage:
    total = Usage(prompt_tokens=0)
    for usage in usages:
        total.prompt_tokens += usage.prompt_tokens
        total.completion_tokens += usage.completion_tokens
        total.cached_prompt_tokens += usage.cached_prompt_tokens
    return total

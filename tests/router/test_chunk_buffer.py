"""A consumer that lags gets each sequence's waiting chunks joined, in order, with nothing
lost; one that keeps up gets every chunk as it came."""

from __future__ import annotations

import asyncio

import pytest

from tandem.engine.request import FinishReason
from tandem.engine.sampler import TopLogprobs
from tandem.router.chunk_buffer import ChunkBuffer
from tandem.router.chunk_stream import ChunkStream, MergedChunks
from tandem.router.generation_chunk import GenerationChunk, Usage

pytestmark = pytest.mark.timeout(30)


def token_chunk(index: int, token: int, finish: FinishReason | None = None) -> GenerationChunk:
    return GenerationChunk(
        token_ids=[token],
        text=f"<{token}>",
        logprobs=[-token / 10],
        index=index,
        top_logprobs=[TopLogprobs([token], [-token / 10])],
        finish_reason=finish,
        usage=Usage(prompt_tokens=3, completion_tokens=token) if finish else None,
        stop_reason=token if finish else None,
    )


def test_waiting_chunks_of_a_sequence_come_out_as_one():
    async def scenario() -> list[object]:
        buffer = ChunkBuffer()
        first = token_chunk(0, 1)
        first.prompt_logprobs = [None, -0.5]
        buffer.put(first)
        buffer.put(token_chunk(1, 2))
        buffer.put(token_chunk(0, 3))
        buffer.put(token_chunk(1, 4))
        buffer.put(token_chunk(0, 5, FinishReason.STOP))
        buffer.put("end")
        return [await buffer.get() for _ in range(3)]

    zero, one, end = asyncio.run(scenario())
    assert isinstance(zero, GenerationChunk) and isinstance(one, GenerationChunk)
    assert zero.token_ids == [1, 3, 5]
    assert zero.text == "<1><3><5>"
    assert zero.logprobs == [-0.1, -0.3, -0.5]
    assert [top.token_ids for top in zero.top_logprobs] == [[1], [3], [5]]
    assert zero.prompt_logprobs == [None, -0.5]
    assert (zero.finish_reason, zero.stop_reason) == (FinishReason.STOP, 5)
    assert zero.usage == Usage(prompt_tokens=3, completion_tokens=5)
    assert (one.index, one.token_ids, one.text, one.finish_reason) == (1, [2, 4], "<2><4>", None)
    assert end == "end"


def test_a_consumer_that_keeps_up_gets_every_chunk_as_it_came():
    async def scenario() -> list[list[int]]:
        buffer = ChunkBuffer()
        taken = []
        for token in range(4):
            buffer.put(token_chunk(0, token))
            chunk = await buffer.get()
            assert isinstance(chunk, GenerationChunk)
            taken.append(chunk.token_ids)
        return taken

    assert asyncio.run(scenario()) == [[0], [1], [2], [3]]


async def _produce(num_tokens: int, num_sequences: int):
    for token in range(num_tokens):
        for index in range(num_sequences):
            finish = FinishReason.LENGTH if token == num_tokens - 1 else None
            yield token_chunk(index, token, finish)
        await asyncio.sleep(0)  # the model's step: the consumer may run


def test_a_slow_consumer_of_a_request_gets_fewer_chunks_and_every_token():
    async def scenario() -> tuple[int, dict[int, list[int]]]:
        tokens: dict[int, list[int]] = {0: [], 1: []}
        num_chunks = 0
        stream = ChunkStream(_produce(200, 2))
        async for chunk in stream:
            num_chunks += 1
            tokens[chunk.index] += chunk.token_ids
            await asyncio.sleep(0.005)  # a slow client's write
        await stream.aclose()
        return num_chunks, tokens

    num_chunks, tokens = asyncio.run(scenario())
    assert tokens == {0: list(range(200)), 1: list(range(200))}
    assert num_chunks < 40  # 400 chunks came


def test_merged_streams_join_a_slow_consumers_chunks_per_index():
    async def scenario() -> tuple[int, dict[int, str]]:
        texts: dict[int, str] = {0: "", 1: "", 2: ""}
        num_chunks = 0
        merged = MergedChunks()
        merged.start(_produce(100, 1))
        merged.start(_produce(100, 2), first_index=1)
        try:
            async for chunk in merged.chunks():
                num_chunks += 1
                texts[chunk.index] += chunk.text
                await asyncio.sleep(0.005)
        finally:
            await merged.close()
        return num_chunks, texts

    num_chunks, texts = asyncio.run(scenario())
    expected = "".join(f"<{token}>" for token in range(100))
    assert texts == {0: expected, 1: expected, 2: expected}
    assert num_chunks < 30  # 300 chunks came

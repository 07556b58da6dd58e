"""The token-budget scheduler on its own: what each step schedules, and what it frees.

The scheduler runs with its real block pool and KV cache manager; the model is left
out. A step feeds `update` one token per sampling chunk, drawn from a fixed function of
the request and its position, so every output sequence is known in advance.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.engine.block_pool import BlockPool
from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import FinishReason, Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import SampledToken, Scheduler, SchedulerOutput

BLOCK = 16
EOS = 2  # the tiny model's </s>


def make_scheduler(model_dir: Path, **overrides) -> Scheduler:
    settings = {"max_model_len": 1024, "block_size": BLOCK, **overrides}
    config = EngineConfig(model=str(model_dir), **settings)
    kv = KVCacheManager(BlockPool(config.num_blocks), BLOCK, config.enable_prefix_caching)
    return Scheduler(config, kv)


def request(req_id: str, num_prompt: int, max_tokens: int = 8, first: int = 3, **params) -> Request:
    """A request whose prompt is `first, first + 1, ...` (ids stay clear of BOS/EOS)."""
    prompt = [first + i % 1000 for i in range(num_prompt)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))


def token_for(req: Request) -> int:
    """The token 'sampled' for `req` after its current tokens (never EOS)."""
    return 100 + (sum(map(ord, req.req_id)) * 31 + req.num_tokens * 7) % 1000


def expected_outputs(req_id: str, num_prompt: int, num_outputs: int) -> list[int]:
    probe = Request(req_id, [0] * num_prompt, SamplingParams())
    outputs = []
    for _ in range(num_outputs):
        outputs.append(token_for(probe))
        probe.output_token_ids.append(outputs[-1])
    return outputs


def step(sched: Scheduler, sample: Callable[[Request], int] = token_for) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {
        c.request.req_id: SampledToken(sample(c.request), -0.5) for c in out.chunks if c.samples
    }
    sched.update(out, sampled)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.request.req_id, c.num_new_tokens) for c in out.chunks]


def assert_all_free(sched: Scheduler) -> None:
    assert not sched.running and not sched.waiting
    assert sched.kv.block_ids == {}
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks


def test_decodes_go_first_then_prefill_chunks_fill_the_budget(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, max_num_batched_tokens=64, num_blocks=64)
    a = request("a", 10, max_tokens=20)
    sched.add(a)
    assert plan(step(sched)) == [("a", 10)]  # the whole prompt, and a first token
    b = request("b", 200, max_tokens=2, first=500)
    sched.add(b)
    # Each step: a's decode token first, then b's prompt in chunks of what is left.
    assert plan(step(sched)) == [("a", 1), ("b", 63)]
    assert plan(step(sched)) == [("a", 1), ("b", 63)]
    assert plan(step(sched)) == [("a", 1), ("b", 63)]
    assert plan(step(sched)) == [("a", 1), ("b", 11)]
    assert len(b.output_token_ids) == 1  # b's last chunk sampled its first token
    assert plan(step(sched)) == [("a", 1), ("b", 1)]  # both decoding now
    assert a.num_computed_tokens == 10 + 5 and len(a.output_token_ids) == 6


def test_a_prompt_mid_prefill_keeps_its_place_before_new_requests(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, max_num_batched_tokens=32, num_blocks=64)
    sched.add(request("long", 80, max_tokens=1))
    assert plan(step(sched)) == [("long", 32)]
    sched.add(request("short", 5, max_tokens=1, first=700))
    # The running prefill's next chunk comes before the newcomer, which gets the rest.
    assert plan(step(sched)) == [("long", 32)]
    assert plan(step(sched)) == [("long", 16), ("short", 5)]
    assert_all_free(sched)


def test_chunking_off_admits_a_prompt_only_whole(tiny_model_dir):
    sched = make_scheduler(
        tiny_model_dir,
        max_model_len=128,
        max_num_batched_tokens=128,
        enable_chunked_prefill=False,
        num_blocks=64,
    )
    sched.add(request("a1", 4, max_tokens=3))
    sched.add(request("a2", 4, max_tokens=3, first=50))
    assert plan(step(sched)) == [("a1", 4), ("a2", 4)]
    sched.add(request("b", 127, max_tokens=1, first=200))
    # 126 tokens of budget left after two decodes: b does not fit whole, so it waits.
    out = step(sched)
    assert plan(out) == [("a1", 1), ("a2", 1)]
    assert [r.req_id for r in sched.waiting] == ["b"]
    assert sched.waiting[0].status is RequestStatus.WAITING
    assert plan(step(sched)) == [("a1", 1), ("a2", 1)]  # a1, a2 finish (3 tokens)
    assert plan(step(sched)) == [("b", 127)]
    assert_all_free(sched)


def test_max_num_seqs_caps_the_running_batch(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, max_num_seqs=2, num_blocks=64)
    for i, max_tokens in enumerate((2, 4, 4)):
        sched.add(request(f"r{i}", 8, max_tokens=max_tokens, first=10 + 100 * i))
    assert plan(step(sched)) == [("r0", 8), ("r1", 8)]
    assert [r.req_id for r in sched.waiting] == ["r2"]
    # r0 finishes on this step (its 2nd token); r2 joins only on the next one.
    assert plan(step(sched)) == [("r0", 1), ("r1", 1)]
    assert [r.req_id for r in sched.running] == ["r1"]
    assert plan(step(sched)) == [("r1", 1), ("r2", 8)]
    assert len(sched.running) == 2


def test_prefix_cache_hits_reduce_the_scheduled_tokens(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, num_blocks=64)
    sched.add(request("first", 100, max_tokens=1))
    assert plan(step(sched)) == [("first", 100)]
    assert_all_free(sched)  # finished: blocks free, full ones still cached
    assert sched.kv.pool.num_cached_blocks == 100 // BLOCK

    # Same 96-token prefix (6 full blocks) and a different tail of 20 tokens.
    second = request("second", 116, max_tokens=1)
    second.prompt_token_ids[96:] = [900 + i for i in range(20)]
    sched.add(second)
    assert plan(step(sched)) == [("second", 20)]
    assert second.num_cached_tokens == 96
    # An identical prompt still recomputes its last token (its logits give the sample).
    again = request("again", 100, max_tokens=1)
    sched.add(again)
    assert plan(step(sched)) == [("again", 4)]
    assert again.num_cached_tokens == 96
    assert (sched.kv.num_prefix_queries, sched.kv.num_prefix_hits) == (316, 192)
    assert_all_free(sched)


def test_prefix_caching_off_schedules_every_prompt_token(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, num_blocks=64, enable_prefix_caching=False)
    for req_id in ("first", "again"):
        sched.add(request(req_id, 100, max_tokens=1))
        assert plan(step(sched)) == [(req_id, 100)]
    assert sched.kv.pool.num_cached_blocks == 0
    assert_all_free(sched)


def test_preemption_under_block_pressure_recomputes_and_resumes(tiny_model_dir):
    # 4 blocks of 16 tokens; two requests that each grow to 50 tokens (4 blocks).
    sched = make_scheduler(tiny_model_dir, num_blocks=4, enable_prefix_caching=False)
    a = request("a", 20, max_tokens=30)
    b = request("b", 20, max_tokens=30, first=300)
    sched.add(a)
    sched.add(b)
    assert plan(step(sched)) == [("a", 20), ("b", 20)]
    # Decoding fills both requests' second blocks (positions up to 31) ...
    for _ in range(12):
        assert plan(step(sched)) == [("a", 1), ("b", 1)]
    assert a.num_computed_tokens == 32 and sched.kv.pool.num_free_blocks == 0
    # ... then a needs a third block: b, the latest admitted, is preempted for it.
    out = step(sched)
    assert plan(out) == [("a", 1)] and out.preempted == [b]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert "b" not in sched.kv.block_ids and list(sched.waiting) == [b]
    assert len(b.output_token_ids) == 13 and sched.num_preemptions == 1
    # b cannot come back while a holds 3 or 4 blocks and b needs 3 for its 33 tokens.
    while a in sched.running:
        assert plan(step(sched)) == [("a", 1)]
        assert list(sched.waiting) == [b]
    assert a.finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == expected_outputs("a", 20, 30)
    # Resumed: its prompt and 13 outputs so far are recomputed as one chunk, and the
    # step samples its 14th token; it then decodes to exactly 30 tokens.
    assert plan(step(sched)) == [("b", 33)]
    assert len(b.output_token_ids) == 14
    assert b.status is RequestStatus.RUNNING and b.num_preemptions == 1
    while b in sched.running:
        assert plan(step(sched)) == [("b", 1)]
    assert b.output_token_ids == expected_outputs("b", 20, 30)
    assert b.finish_reason is FinishReason.LENGTH
    assert_all_free(sched)


def test_a_request_that_alone_outgrows_the_pool_preempts_itself(tiny_model_dir):
    # (The engine refuses such a request up front; the scheduler must still not loop.)
    sched = make_scheduler(tiny_model_dir, num_blocks=2, enable_prefix_caching=False)
    r = request("r", 30, max_tokens=10)
    sched.add(r)
    assert plan(step(sched)) == [("r", 30)]
    assert plan(step(sched)) == [("r", 1)]  # position 30
    assert plan(step(sched)) == [("r", 1)]  # position 31: the end of block 2
    out = step(sched)  # position 32 needs a third block: nothing left to take it from
    assert out.chunks == [] and out.preempted == [r]
    assert list(sched.waiting) == [r] and sched.kv.pool.num_free_blocks == 2


@pytest.mark.parametrize(
    ("params", "sample", "reason", "num_outputs", "stop_reason"),
    [
        ({"max_tokens": 5, "ignore_eos": True}, token_for, FinishReason.LENGTH, 5, None),
        ({"max_tokens": 50}, lambda req: EOS, FinishReason.STOP, 1, None),
        ({"max_tokens": 50, "ignore_eos": True}, lambda req: EOS, FinishReason.LENGTH, 50, None),
        ({"max_tokens": 50, "stop_token_ids": [777]}, lambda req: 777, FinishReason.STOP, 1, 777),
        # EOS comes first even when it is a stop token id too (vLLM: no stop_reason).
        ({"max_tokens": 50, "stop_token_ids": [EOS]}, lambda req: EOS, FinishReason.STOP, 1, None),
        ({"max_tokens": 50, "min_tokens": 3}, lambda req: EOS, FinishReason.STOP, 3, None),
    ],
)
def test_finished_requests_free_their_blocks(
    tiny_model_dir, params, sample, reason, num_outputs, stop_reason
):
    sched = make_scheduler(tiny_model_dir, num_blocks=16)
    r = Request("r", [3] * 40, SamplingParams(**params))
    sched.add(r)
    while not r.is_finished:
        assert step(sched, sample).chunks
    assert r.finish_reason is reason and len(r.output_token_ids) == num_outputs
    assert r.stop_reason == stop_reason
    assert_all_free(sched)


def test_prefill_only_requests_finish_prefilled_with_their_blocks_kept(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, num_blocks=16, mode=EngineMode.PREFILL_ONLY)
    r = request("r", 40, max_tokens=8)
    sched.add(r)
    assert plan(step(sched)) == [("r", 40)]
    assert r.finish_reason is FinishReason.PREFILLED and len(r.output_token_ids) == 1
    assert not sched.running
    # The engine holds these blocks for the KV transfer until it releases them.
    assert len(sched.kv.block_ids["r"]) == 3
    sched.kv.free(r)
    assert sched.kv.pool.num_free_blocks == 16


def test_abort_of_a_waiting_or_running_request_frees_everything(tiny_model_dir):
    sched = make_scheduler(tiny_model_dir, max_num_seqs=1, num_blocks=16)
    running, waiting = request("run", 40), request("wait", 40, first=600)
    sched.add(running)
    sched.add(waiting)
    step(sched)
    assert sched.running == [running] and list(sched.waiting) == [waiting]
    sched.finish(waiting, FinishReason.ABORT)
    sched.finish(running, FinishReason.ABORT)
    assert running.finish_reason is waiting.finish_reason is FinishReason.ABORT
    assert_all_free(sched)

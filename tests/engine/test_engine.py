"""Engine behaviour: KV hand-off between engines, leases, aborts, stops, bad input.

Every test ends with the pools back to idle.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.generate import generate
from tandem.engine.llm_engine import Engine
from tandem.engine.request import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tests.helpers.clock import FakeClock
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.kv_budget import with_test_kv
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)


def make_engine(model_dir, clock=time.monotonic, **overrides) -> Engine:
    return Engine(
        EngineConfig(model=str(model_dir), max_model_len=1024, **with_test_kv(overrides)),
        clock=clock,
    )


def drain(engine: Engine, limit: int = 10_000) -> list:
    outputs = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outputs
        outputs += engine.step()
    raise AssertionError("engine did not finish its requests")


def test_prefill_engine_kv_moved_to_decode_engine_matches_transformers(tiny_model_dir):
    prompts = make_prompts(2048, (5, 40, 129, 300), seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    prefill = make_engine(tiny_model_dir, mode=EngineMode.PREFILL_ONLY, max_num_batched_tokens=64)
    decode = make_engine(tiny_model_dir, mode=EngineMode.DECODE_ONLY)
    first_tokens = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params)
    for out in drain(prefill):
        assert out.finished and out.finish_reason is FinishReason.PREFILLED
        first_tokens[out.req_id] = out.new_token_ids[0]
    assert prefill.stats().num_held == len(prompts)
    for i, prompt in enumerate(prompts):
        req_id = f"r{i}"
        exported = prefill.export_kv(req_id)
        assert exported.num_tokens == len(prompt)
        block_ids = decode.reserve_import(req_id, prompt, first_tokens[req_id], params)
        assert block_ids is not None and len(block_ids) == len(exported.block_ids)
        decode.write_kv(req_id, exported.blocks)
        decode.commit_import(req_id)
        assert prefill.release(req_id)
    generated = {f"r{i}": [first_tokens[f"r{i}"]] for i in range(len(prompts))}
    for out in drain(decode):
        generated[out.req_id] += out.new_token_ids
    expected = hf_greedy(tiny_model_dir, prompts, 16)
    assert [generated[f"r{i}"] for i in range(len(prompts))] == expected
    assert prefill.is_idle() and decode.is_idle()


def test_decode_only_engine_prefills_only_when_told(tiny_model_dir):
    """A decode-only engine's entry is imported KV; a prompt is prefilled locally only
    with `local_prefill=True` (conditional disaggregation or pull recovery)."""
    decode = make_engine(tiny_model_dir, mode=EngineMode.DECODE_ONLY)
    prompt = make_prompts(2048, (40,), seed=5)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with pytest.raises(ValueError, match=r"decode-only engine .* only when asked to"):
        decode.add_request("stray", prompt, params)
    assert decode.is_idle()
    decode.add_request("asked", prompt, params, local_prefill=True)
    outputs = drain(decode)
    assert [t for out in outputs for t in out.new_token_ids] == hf_greedy(
        tiny_model_dir, [prompt], 8
    )[0]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    # Engines of the other modes prefill whatever they are given.
    colocated = make_engine(tiny_model_dir)
    colocated.add_request("plain", prompt, params)
    assert drain(colocated)[-1].finished


def test_released_prefill_blocks_stay_in_prefix_cache(tiny_model_dir):
    prefill = make_engine(tiny_model_dir, mode=EngineMode.PREFILL_ONLY)
    prompt = make_prompts(2048, (100,))[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prefill.add_request("a", prompt, params)
    drain(prefill)
    prefill.release("a")
    prefill.add_request("b", prompt, params)
    [out] = drain(prefill)
    assert out.num_cached_tokens == 96
    prefill.release("b")
    assert prefill.is_idle()


def test_unpulled_lease_expires_and_frees_blocks(tiny_model_dir):
    clock = FakeClock()
    prefill = make_engine(tiny_model_dir, clock, mode=EngineMode.PREFILL_ONLY, kv_lease_s=5.0)
    prefill.add_request("a", make_prompts(2048, (70,))[0], SamplingParams(max_tokens=4))
    drain(prefill)
    assert prefill.stats().num_free_blocks < prefill.stats().num_blocks
    clock.advance(4.9)
    assert prefill.expire_leases(clock()) == [] and prefill.stats().num_held == 1
    clock.advance(0.2)
    assert prefill.expire_leases(clock()) == ["a"]
    with pytest.raises(KeyError):
        prefill.export_kv("a")
    assert prefill.is_idle()


def test_reserve_import_refuses_when_pool_is_full_and_cancel_frees(tiny_model_dir):
    decode = make_engine(tiny_model_dir, num_blocks=8)
    params = SamplingParams(max_tokens=4)
    prompt = make_prompts(2048, (100,))[0]  # 7 blocks
    assert decode.reserve_import("a", prompt, 5, params) is not None
    assert decode.reserve_import("b", prompt, 5, params) is None
    assert decode.cancel_import("a")
    assert decode.is_idle()


def test_abort_mid_generation_frees_blocks(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(2048, (30, 300), seed=4)):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(5):
        engine.step()
    assert engine.abort("r0") and engine.abort("r1")
    assert not engine.abort("r1")
    assert engine.step() == []
    assert engine.is_idle()


def test_max_tokens_and_ignore_eos_give_exact_length(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True)
    [out] = generate(engine, make_prompts(2048, (12,)), params)
    assert len(out.token_ids) == 37 and out.finish_reason == "length"
    assert engine.is_idle()


def test_stop_string_truncates_output(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = [engine.tokenizer.encode("the model and the cache")]
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    [full] = generate(engine, prompt, base)
    text = full.text
    assert len(text) > 10, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    [stopped] = generate(engine, prompt, SamplingParams(**{**vars(base), "stop": [stop]}), "s")
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[:cut]
    assert full.stop_reason is None  # ended by length
    assert engine.is_idle()


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(tiny_model_dir):
    """The token that reaches max_tokens also completes a stop string: the text ends at
    the stop string, so the finish reason is `stop` (OpenAI's and vLLM's), not `length`."""
    engine = make_engine(tiny_model_dir)
    prompt = [engine.tokenizer.encode("the model and the cache")]
    base = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [full] = generate(engine, prompt, base)
    stop = engine.tokenizer.decode(full.token_ids[-1:]).strip()
    cut = full.text.index(stop)
    # Set-up: the stop string's first whole occurrence ends in the last token's text.
    assert cut + len(stop) > len(engine.tokenizer.decode(full.token_ids[:-1])), full
    [stopped] = generate(engine, prompt, SamplingParams(**{**vars(base), "stop": [stop]}), "s")
    assert stopped.token_ids == full.token_ids and stopped.text == full.text[:cut]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert engine.is_idle()


def test_stop_string_in_the_first_token_ends_the_request_at_the_prefill(tiny_model_dir):
    """A prefill engine's first token that completes a stop string ends the request there
    (stop, its KV freed, not held for a decode worker that would decode past the stop)."""
    engine = make_engine(tiny_model_dir)
    prompt = engine.tokenizer.encode("the model and the cache")
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    [free_run] = generate(engine, [prompt], greedy)
    first_text = free_run.text.strip()
    assert first_text, free_run
    stop = first_text[-1]
    cut = free_run.text.index(stop)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop])
    prefill = make_engine(tiny_model_dir, mode=EngineMode.PREFILL_ONLY)
    prefill.add_request("s", prompt, params)
    [out] = drain(prefill)
    assert out.finished and out.finish_reason is FinishReason.STOP
    assert out.stop_reason == stop
    assert out.new_token_ids == free_run.token_ids
    assert out.delta_text == free_run.text[:cut]
    assert prefill.stats().num_held == 0
    with pytest.raises(KeyError):
        prefill.export_kv("s")
    assert prefill.is_idle() and engine.is_idle()


def test_stop_token_ids_and_min_tokens(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = make_prompts(2048, (20,), seed=5)
    [free_run] = generate(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0))
    first = free_run.token_ids[0]
    stop_at_first = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first])
    [stopped] = generate(engine, prompt, stop_at_first, "a")
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == first
    held_off = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first], min_tokens=3,
                              logprobs=True, top_logprobs=2)  # fmt: skip
    [later] = generate(engine, prompt, held_off, "b")
    assert len(later.token_ids) >= 3 and first not in later.token_ids[:3]
    # The logprobs are the model's, as if nothing were held off (vLLM): the token it may
    # not draw yet is still the most likely, with its logprob from the free run.
    ranked = dataclasses.replace(held_off, min_tokens=0, stop_token_ids=[])
    [free_ranked] = generate(engine, prompt, ranked, "c")
    top = later.top_logprobs[0]
    assert top.token_ids == free_ranked.top_logprobs[0].token_ids and top.token_ids[0] == first
    assert top.logprobs == pytest.approx(free_ranked.top_logprobs[0].logprobs, abs=1e-5)
    assert later.logprobs[0] == pytest.approx(top.logprobs[1], abs=1e-5)
    assert engine.is_idle()


def test_a_stop_token_ends_the_ids_not_the_text(tiny_model_dir):
    """vLLM: the stop token that ends a request (a stop token id, EOS) is the last token
    id, but its text is left out unless include_stop_str_in_output."""
    engine = make_engine(tiny_model_dir)
    prompt = make_prompts(2048, (20,), seed=5)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [free_run] = generate(engine, prompt, greedy)
    cut = next(i for i, t in enumerate(free_run.token_ids) if t not in free_run.token_ids[:i] and i)
    stop = free_run.token_ids[cut]
    prefix = {}
    for n in (cut, cut + 1):
        [prefix[n]] = generate(engine, prompt, dataclasses.replace(greedy, max_tokens=n), f"p{n}")
    assert prefix[cut + 1].text != prefix[cut].text  # the stop token has text of its own
    for include, expected in ((False, prefix[cut].text), (True, prefix[cut + 1].text)):
        params = dataclasses.replace(
            greedy, stop_token_ids=[stop], include_stop_str_in_output=include
        )
        [stopped] = generate(engine, prompt, params, f"s{include}")
        assert stopped.token_ids == free_run.token_ids[: cut + 1]
        assert (stopped.finish_reason, stopped.text) == ("stop", expected)
    # EOS shown as text (skip_special_tokens off) is left out the same way.
    eos = engine.config.model_config.eos_token_ids[0]
    forced = SamplingParams(max_tokens=4, temperature=0.0, skip_special_tokens=False,
                            allowed_token_ids=[eos])  # fmt: skip
    [ended] = generate(engine, prompt, forced, "eos")
    assert (ended.token_ids, ended.finish_reason, ended.text) == ([eos], "stop", "")
    assert engine.is_idle()


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompts = make_prompts(2048, (10, 50, 90), seed=6)
    seeded = SamplingParams(
        max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=1234, logprobs=True
    )
    other = SamplingParams(max_tokens=12, temperature=1.0)
    [alone] = generate(engine, prompts[:1], seeded, "alone")
    batch = generate(engine, prompts, [seeded, other, other], "batch")
    assert batch[0].token_ids == alone.token_ids
    assert all(lp <= 0.0 for lp in alone.logprobs) and len(alone.logprobs) == 12
    assert engine.is_idle()


def test_seeded_draws_follow_the_token_not_the_worker(tiny_model_dir):
    """A seeded request samples the same tokens when one engine runs it whole, when a
    prefill engine samples its first token and a decode engine the rest, and when it is
    resumed mid-way (a migration: its generated tokens re-sent as prompt)."""
    [prompt] = make_prompts(2048, (20,), seed=11)
    params = SamplingParams(max_tokens=12, temperature=2.0, seed=99, ignore_eos=True)
    [whole] = generate(make_engine(tiny_model_dir), [prompt], params, "whole")

    prefill = make_engine(tiny_model_dir, mode=EngineMode.PREFILL_ONLY)
    decode = make_engine(tiny_model_dir, mode=EngineMode.DECODE_ONLY)
    prefill.add_request("r", prompt, params)
    [prefilled] = drain(prefill)
    decode.reserve_import("r", prompt, prefilled.new_token_ids[0], params)
    decode.write_kv("r", prefill.export_kv("r").blocks)
    decode.commit_import("r")
    assert prefill.release("r")
    handed_off = prefilled.new_token_ids + [t for out in drain(decode) for t in out.new_token_ids]
    assert handed_off == whole.token_ids

    done = 5
    resumed_params = dataclasses.replace(
        params, max_tokens=params.max_tokens - done, num_resumed_tokens=done
    )
    [rest] = generate(
        make_engine(tiny_model_dir), [prompt + whole.token_ids[:done]], resumed_params, "resumed"
    )
    assert whole.token_ids[:done] + rest.token_ids == whole.token_ids
    # The draws are really random: another seed samples another sequence.
    [other] = generate(
        make_engine(tiny_model_dir), [prompt], dataclasses.replace(params, seed=100), "other"
    )
    assert other.token_ids != whole.token_ids
    assert prefill.is_idle() and decode.is_idle()


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "at least one token"),
        ([1, 5000], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1] * 1024, SamplingParams(), "max_model_len"),
        ([1, 2.5], SamplingParams(), "must be ints"),
    ],
)
def test_bad_input_is_rejected_and_nothing_is_kept(tiny_model_dir, prompt, params, message):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests() and engine.is_idle()


def test_duplicate_request_id_and_oversized_request_are_rejected(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=4)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("b", [1] * 60, SamplingParams(max_tokens=20))
    drain(engine)
    assert engine.is_idle()


def test_config_validation_names_the_field(tiny_model_dir):
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(model=str(tiny_model_dir), block_size=12)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(
            model=str(tiny_model_dir), enable_chunked_prefill=False, max_num_batched_tokens=64
        )
    with pytest.raises(ValueError, match="mode must be one of colocated, prefill_only"):
        EngineConfig(model=str(tiny_model_dir), mode="decode")
    with pytest.raises(FileNotFoundError):
        EngineConfig(model=str(tiny_model_dir / "missing"))

"""Grammar-constrained decoding in the engine: mask, advance, end, and the hand-off of
matcher state from a prefill-only engine to a decode-only one (as the workers do it)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.llm_engine import Engine
from tandem.engine.request import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured.spec import GuidedDecoding, GuidedKind
from tandem.worker.convert import sampling_params_from_proto, sampling_params_to_proto
from tests.helpers.kv_budget import with_test_kv

pytestmark = pytest.mark.timeout(300)

OPTION = "decode prefill batch queue"


def make_engine(model_dir, **overrides) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), max_model_len=512, **with_test_kv(overrides)))


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    """A colocated engine shared by the tests below (each leaves it idle)."""
    return make_engine(tiny_model_dir)


def run(engine: Engine, limit: int = 2_000) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.req_id, []).append(out)
    raise AssertionError("engine did not finish its requests")


def text_of(outs: list) -> str:
    return "".join(o.delta_text for o in outs)


def test_constraints_hold_and_end_with_stop_even_past_ignore_eos(engine):
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    cases = {
        "choice": GuidedDecoding.choice([OPTION, "x"]),
        "regex": GuidedDecoding(GuidedKind.REGEX, r"[a-c]{4}-[0-9]{2}"),
        "ebnf": GuidedDecoding(GuidedKind.GRAMMAR, 'root ::= "yes" | "no"'),
        "json": GuidedDecoding.json_schema(schema),
    }
    for name, guided in cases.items():
        params = SamplingParams(max_tokens=64, temperature=1.0, seed=1, structured=guided)
        engine.add_request(name, "the quick", params)
    engine.add_request(
        "eos", "the", SamplingParams(max_tokens=64, ignore_eos=True, structured=cases["ebnf"])
    )
    outputs = run(engine)
    texts = {name: text_of(outs) for name, outs in outputs.items()}
    assert texts["choice"] in (OPTION, "x")
    assert len(texts["regex"]) == 7 and texts["regex"][4] == "-"
    assert texts["ebnf"] in ("yes", "no") and texts["eos"] in ("yes", "no")
    jsonschema.validate(json.loads(texts["json"]), schema)
    assert all(outs[-1].finish_reason is FinishReason.STOP for outs in outputs.values())
    assert engine.is_idle()
    assert engine.structured.cache.num_hits >= 1  # "eos" reused the "ebnf" grammar


def test_matcher_state_crosses_from_prefill_to_decode_engine(tiny_model_dir):
    """One legal token at each step: the decode engine must resume after the prefill
    engine's first token (a fresh matcher would force the option's first token again)."""
    params = SamplingParams(
        max_tokens=32, temperature=1.0, structured=GuidedDecoding.choice([OPTION])
    )
    # Through the wire message, as the router → workers hand it on.
    params = sampling_params_from_proto(sampling_params_to_proto(params))
    prefill = make_engine(tiny_model_dir, mode=EngineMode.PREFILL_ONLY)
    decode = make_engine(tiny_model_dir, mode=EngineMode.DECODE_ONLY)
    prompt = prefill.tokenizer.encode("the")
    prefill.add_request("r", prompt, params)
    (first,) = run(prefill)["r"]
    assert first.finish_reason is FinishReason.PREFILLED
    exported = prefill.export_kv("r")
    assert decode.reserve_import("r", prompt, first.new_token_ids[0], params) is not None
    decode.write_kv("r", exported.blocks)
    decode.commit_import("r")
    rest = run(decode)["r"]
    assert first.delta_text + text_of(rest) == OPTION
    assert rest[-1].finish_reason is FinishReason.STOP
    # A first token outside the grammar is refused at the hand-off; nothing is kept.
    wrong = prefill.tokenizer.encode(" queue", add_special_tokens=False)[0]
    assert decode.reserve_import("bad", prompt, wrong, params) is not None
    decode.write_kv("bad", exported.blocks)
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        decode.commit_import("bad")
    prefill.release("r")
    assert prefill.is_idle() and decode.is_idle()


def test_migrated_request_resumes_with_streamed_tokens_accepted(engine):
    """What the router sends after a migration: prompt + streamed tokens as the prompt,
    the grammar continued past the streamed tokens."""
    streamed = engine.tokenizer.encode("decode pre", add_special_tokens=False)
    prompt = engine.tokenizer.encode("the")
    guided = GuidedDecoding.choice([OPTION]).continued(streamed)
    params = SamplingParams(max_tokens=32, temperature=1.0, structured=guided)
    engine.add_request("r", [*prompt, *streamed], params)
    outs = run(engine)["r"]
    ids = streamed + [t for o in outs for t in o.new_token_ids]
    assert engine.tokenizer.decode(ids, skip_special_tokens=True) == OPTION
    assert engine.is_idle()


def test_bad_grammar_is_refused_and_the_engine_keeps_serving(engine):
    bad = SamplingParams(structured=GuidedDecoding(GuidedKind.REGEX, r"(?=x)a"))
    try:  # refused at once if its compilation already failed, else aborted when it does
        engine.add_request("bad", "the", bad)
    except ValueError:
        pass
    else:
        (out,) = run(engine)["bad"]
        assert out.new_token_ids == [] and out.finish_reason is FinishReason.ABORT
        assert out.cannot_start is not None and not out.cannot_start.timed_out
    # Cached as failed: the second request is refused at once.
    with pytest.raises(ValueError, match="Lookahead"):
        engine.add_request("bad2", "the", bad)
    engine.add_request("ok", "the", SamplingParams(max_tokens=4, temperature=0.0))
    assert run(engine)["ok"][-1].finished
    assert engine.is_idle()


def test_a_grammar_that_ends_before_min_tokens_ends_the_output_there(engine):
    """min_tokens bans EOS, but a finished grammar allows nothing else: the grammar wins
    (the output ends with `stop`, valid). The ban emptied the row: the engine drew token
    0, the grammar refused it, and the request aborted with '<unk>' appended."""
    params = SamplingParams(max_tokens=64, min_tokens=20, temperature=0.0,
                            structured=GuidedDecoding.choice(["yes", "no"]))  # fmt: skip
    engine.add_request("early", "the quick", params)
    outs = run(engine)["early"]
    assert text_of(outs) in ("yes", "no")
    assert outs[-1].finish_reason is FinishReason.STOP
    assert engine.is_idle()

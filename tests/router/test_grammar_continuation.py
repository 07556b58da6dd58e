"""A migrated request's grammar resumes after the tokens already streamed."""

from __future__ import annotations

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured.spec import GuidedDecoding
from tandem.router.continuation import continuation_params
from tandem.worker.convert import sampling_params_from_proto, sampling_params_to_proto


def test_continuation_accepts_the_streamed_tokens_and_crosses_the_wire():
    guided = GuidedDecoding.choice(["decode prefill batch"])
    params = SamplingParams(max_tokens=20, structured=guided)
    rest = continuation_params(params, [5, 6, 7], router_stops=True)
    assert rest.max_tokens == 17
    assert rest.structured is not None
    assert rest.structured.accepted_token_ids == (5, 6, 7)
    assert rest.structured.cache_key == guided.cache_key  # same compiled grammar
    again = sampling_params_from_proto(sampling_params_to_proto(rest))
    assert again.structured == rest.structured
    plain = continuation_params(SamplingParams(max_tokens=4), [1], router_stops=False)
    assert plain.structured is None

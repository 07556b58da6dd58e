"""The router's attempts per worker: what a worker leaving the pools ends."""

from __future__ import annotations

from tandem.router.attempts import AttemptRegistry
from tandem.router.policy import DISAGGREGATED, Placement


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def placement(prefill: str | None, decode: str) -> Placement:
    return Placement(
        prefill_worker_id=prefill, decode_worker_id=decode, decision=DISAGGREGATED,
        predicted_queue_s=0.0, predicted_ttft_s=0.1, predicted_itl_s=0.01,
        num_prompt_tokens=16, num_cached_tokens=0, num_decode_blocks=2, fits=True,
    )  # fmt: skip


def test_a_lost_worker_ends_only_the_calls_in_flight_on_it():
    """Three attempts used prefill-0: one prefilling there now, one decoding on decode-0
    (its prefill there done), one waiting between calls. Losing prefill-0 ends one call
    (what the router logs as ending); all three are marked, so none calls it again."""
    registry = AttemptRegistry()
    prefilling, decoding, between = (
        registry.begin(placement("prefill-0", f"decode-{i}")) for i in range(3)
    )
    prefill_call, decode_call = FakeCall(), FakeCall()
    prefilling.start_call("prefill-0", prefill_call)
    decoding.start_call("decode-1", decode_call)
    assert registry.num_on("prefill-0") == 3
    assert registry.lose_worker("prefill-0") == 1
    assert prefill_call.cancelled and not decode_call.cancelled
    assert all("prefill-0" in a.lost for a in (prefilling, decoding, between))
    assert registry.lose_worker("decode-1") == 1 and decode_call.cancelled
    assert registry.lose_worker("decode-2") == 0

"""One OpenTelemetry trace per request, continued by both workers over gRPC metadata."""

from __future__ import annotations

from dataclasses import replace

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.telemetry.tracing import Tracing
from tests.helpers.grpc_calls import generate_tokens
from tests.helpers.inproc_cluster import InprocCluster, inproc_router_config
from tests.helpers.prompts import make_prompts


@pytest.mark.timeout(300)
def test_request_trace_spans_queue_prefill_transfer_decode(tiny_model_dir):
    exporter = InMemorySpanExporter()
    model_dir = str(tiny_model_dir)
    cluster = InprocCluster(
        model_dir,
        # Always the disaggregated path.
        router_config=replace(inproc_router_config(model_dir), max_local_prefill_tokens=0),
        tracing=Tracing("test", exporter),
    ).start()
    try:
        cluster.run(generate_tokens(cluster.grpc_endpoint, make_prompts(2048, (40,)), 5))
        cluster.assert_idle()
    finally:
        cluster.stop()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    expected = {"tandem.request", "queue", "prefill", "prefill.compute", "kv_transfer", "decode",
                "decode.stream"}  # fmt: skip
    assert expected <= set(spans), sorted(spans)
    root = spans["tandem.request"]
    assert root.parent is None
    assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}
    assert spans["prefill"].parent.span_id == root.context.span_id
    # Worker spans hang under the router span of the call that carried the context.
    assert spans["prefill.compute"].parent.span_id == spans["prefill"].context.span_id
    assert spans["kv_transfer"].parent.span_id == spans["decode"].context.span_id
    assert spans["decode.stream"].parent.span_id == spans["decode"].context.span_id
    assert root.attributes["gen_ai.usage.output_tokens"] == 5


def test_tracing_is_off_by_default_and_rejects_unknown_exporters():
    tracing = Tracing("x")
    assert not tracing.enabled
    assert tracing.metadata(tracing.start_span("s")) == ()
    with pytest.raises(ValueError, match="trace exporter"):
        Tracing("x", "jaeger")

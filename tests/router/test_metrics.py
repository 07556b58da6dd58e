"""`/metrics` after a known workload: counts and histograms match what was sent."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.sampling_params import SamplingParams
from tandem.router.errors import Overloaded, WorkerUnavailable
from tandem.router.metrics import RouterMetrics
from tandem.router.policy import SloConfig
from tandem.router.request_flow import RequestFlow
from tandem.telemetry.tracing import Tracing
from tandem.worker.config import WorkerRole
from tests.helpers.grpc_calls import public_channel
from tests.helpers.inproc_cluster import InprocCluster, inproc_router_config
from tests.helpers.prompts import make_prompts
from tests.helpers.ray_pools import until

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 7


async def run_fixed_length(endpoint: str, prompts: list[list[int]]) -> None:

    from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
    from tandem.proto.tandem.v1 import generation_pb2_grpc

    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for prompt in prompts:
            request = gen_pb.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
            )
            async for _ in stub.Generate(request, timeout=60):
                pass


def scrape(url: str) -> dict[str, float]:
    """Sample name + sorted labels -> value."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                continue
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_metrics_match_a_known_workload(tiny_model_dir):
    prompts = make_prompts(2048, (5, 33, 120, 64, 9), seed=41)
    # Every request through the prefill worker, so the transfer counts are exact.
    model_dir = str(tiny_model_dir)
    router_config = replace(inproc_router_config(model_dir), max_local_prefill_tokens=0)
    cluster = InprocCluster(model_dir, router_config=router_config)
    cluster.start()
    try:
        cluster.run(run_fixed_length(cluster.grpc_endpoint, prompts))
        metrics = scrape(f"{cluster.http_endpoint}/metrics")
        model = f"model_name={cluster.router.config.model_name}"
        n = len(prompts)
        assert metrics[f"tandem:request_success_total{{finished_reason=length,{model}}}"] == n
        assert metrics[f"tandem:prompt_tokens_total{{{model}}}"] == sum(map(len, prompts))
        assert metrics[f"tandem:generation_tokens_total{{{model}}}"] == n * MAX_TOKENS
        assert metrics[f"tandem:request_generation_tokens_sum{{{model}}}"] == n * MAX_TOKENS
        assert metrics[f"tandem:request_generation_tokens_count{{{model}}}"] == n
        assert metrics[f"tandem:time_to_first_token_seconds_count{{{model}}}"] == n
        assert metrics[f"tandem:inter_token_latency_seconds_count{{{model}}}"] == n * (
            MAX_TOKENS - 1
        )
        assert metrics[f"tandem:e2e_request_latency_seconds_count{{{model}}}"] == n
        num_remote = metrics[f"tandem:disagg_decisions_total{{decision=disaggregated,{model}}}"]
        assert num_remote == n
        assert metrics[f"tandem:kv_transfer_seconds_count{{{model}}}"] == n
        assert metrics[f"tandem:num_requests_running{{{model}}}"] == 0
        assert metrics[f"tandem:time_to_first_token_seconds_sum{{{model}}}"] > 0
        endpoints = cluster.worker_metrics_endpoints
        prefill = scrape(f"{endpoints['prefill-0']}/metrics")
        decode = scrape(f"{endpoints['decode-0']}/metrics")
        p_labels, d_labels = "role=prefill,worker_id=prefill-0", "role=decode,worker_id=decode-0"
        assert prefill[f"tandem:prefix_cache_queries_total{{{p_labels}}}"] == sum(map(len, prompts))
        assert prefill[f"tandem:kv_cache_usage_perc{{{p_labels}}}"] == 0.0
        assert decode[f"tandem:kv_transfer_seconds_count{{{d_labels}}}"] == num_remote
        # The TTFT split, TPOT, and per-worker token counts (what the Grafana board reads).
        for split in ("request_queue_time", "request_prefill_time", "time_per_output_token"):
            assert metrics[f"tandem:{split}_seconds_count{{{model}}}"] == n
        hits = prefill[f"tandem:prefix_cache_hits_total{{{p_labels}}}"]
        computed = f"tandem:worker_prompt_tokens_total{{{model},role=prefill,worker_id=prefill-0}}"
        assert metrics[computed] == sum(map(len, prompts)) - hits
        streamed = f"tandem:worker_generation_tokens_total{{{model},worker_id=decode-0}}"
        # The first token of each request comes from the prefill worker.
        assert metrics[streamed] == n * (MAX_TOKENS - 1)
        # Known label values exist before their first event (no "No data" panels).
        assert metrics[f"tandem:disagg_decisions_total{{decision=local_prefill,{model}}}"] == 0
        assert metrics[f"tandem:request_migrations_total{{{model},reason=worker_lost}}"] == 0
        # None waits for admission, none was shed: 0, not a missing series.
        assert metrics[f"tandem:num_requests_waiting{{{model}}}"] == 0
        assert metrics[f"tandem:requests_rejected_total{{{model},reason=overloaded}}"] == 0
        assert decode[f"tandem:kv_transfer_bytes_total{{{d_labels}}}"] > 0
        assert decode[f"tandem:num_requests_running{{{d_labels}}}"] == 0
        cluster.assert_idle()
    finally:
        cluster.stop()


def test_disaggregation_decisions_are_counted_with_conditional_disaggregation(tiny_model_dir):
    # Which way each short prompt goes depends on measured timings (unit-tested in
    # tests/router/policy); here: every decision is counted, and only remote ones
    # move KV.
    prompts = make_prompts(2048, (4, 9, 6, 300), seed=42)
    model_dir = str(tiny_model_dir)
    router_config = replace(inproc_router_config(model_dir), warmup_profile=True)
    cluster = InprocCluster(model_dir, router_config=router_config)
    cluster.start()
    try:
        cluster.run(run_fixed_length(cluster.grpc_endpoint, prompts))
        metrics = scrape(f"{cluster.http_endpoint}/metrics")
        model = f"model_name={cluster.router.config.model_name}"
        decisions = {
            d: metrics.get(f"tandem:disagg_decisions_total{{decision={d},{model}}}", 0)
            for d in ("disaggregated", "local_prefill")
        }
        assert sum(decisions.values()) == len(prompts), decisions
        transfers = metrics.get(f"tandem:kv_transfer_seconds_count{{{model}}}", 0)
        assert transfers == decisions["disaggregated"]
        cluster.assert_idle()
    finally:
        cluster.stop()


def test_local_prefills_teach_the_decode_workers_prefill_model(tiny_model_dir):
    """With no prefill pool every prompt is prefilled where it decodes: each one's
    prefill time (the Decode stream's `prefill_timings`) reaches that worker's prefill
    latency model, which predicts the TTFT of the next local prefill."""
    prompts = make_prompts(2048, (4, 9, 30), seed=43)
    cluster = InprocCluster(str(tiny_model_dir), roles={"decode-0": WorkerRole.DECODE})
    cluster.start()
    try:
        model = cluster.router.policy_runtime.policy.workers["decode-0"].prefill_model
        assert model.num_observations == 0
        cluster.run(run_fixed_length(cluster.grpc_endpoint, prompts))
        assert model.num_observations == len(prompts)
        cluster.assert_idle()
    finally:
        cluster.stop()


def test_ttft_and_goodput_count_the_admission_wait_and_only_finished_requests():
    metrics = RouterMetrics("m")

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0

    # Waited 0.5 s for admission, then its first token came at once: TTFT is 0.5 s, over
    # its 0.3 s target (the wait also feeds the queue part of the TTFT split).
    late = metrics.record(4, ttft_target_s=0.3, arrived_at=time.monotonic() - 0.5)
    late.on_prefill("prefill-0", "prefill", 4, queue_s=0.0, compute_s=0.01)
    late.on_tokens(1)
    late.finish("stop")
    assert value("tandem:time_to_first_token_seconds_sum") >= 0.5
    assert value("tandem:request_queue_time_seconds_sum") >= 0.5
    # Within target, but failed: no goodput either.
    failed = metrics.record(4, ttft_target_s=10.0)
    failed.on_tokens(1)
    failed.finish("error")
    assert value("tandem:goodput_requests_total") == 0
    done = metrics.record(4, ttft_target_s=10.0)
    done.on_tokens(1)
    done.finish("length")
    assert value("tandem:goodput_requests_total") == 1
    assert value("tandem:slo_attainment") == pytest.approx(1 / 3)


def test_requests_waiting_for_admission_are_counted_while_they_wait():
    class HeldPolicy:
        """Places nothing until released, then sheds (the admission queue's end)."""

        def __init__(self) -> None:
            self.release = asyncio.Event()

        async def place(self, request):
            await self.release.wait()
            raise Overloaded("no worker pair can meet the SLO", retry_after_s=1.0)

    async def scenario() -> None:
        metrics, policy = RouterMetrics("m"), HeldPolicy()
        flow = RequestFlow(None, policy, SloConfig(), metrics, Tracing("test", "none"),  # type: ignore[arg-type]
                           30.0, 30.0, migration_wait_s=1.0)  # fmt: skip
        waiting = lambda: metrics.registry.get_sample_value(  # noqa: E731
            "tandem:num_requests_waiting", {"model_name": "m"}
        )
        params = SamplingParams(max_tokens=2)
        streams = [flow.generate(f"r{i}", [1, 2, 3], params) for i in range(2)]
        tasks = [asyncio.create_task(anext(s)) for s in streams]
        await until(lambda: waiting() == 2, 5.0, "two requests waiting")
        policy.release.set()
        for task in tasks:
            with pytest.raises(Overloaded):
                await task
        assert waiting() == 0
        rejected = {"model_name": "m", "reason": "overloaded"}
        assert metrics.registry.get_sample_value("tandem:requests_rejected_total", rejected) == 2

    asyncio.run(scenario())


def test_a_request_with_no_worker_to_place_it_on_counts_as_rejected():
    """A 503 "no decode worker is available" (a whole role down) was in no series:
    clients got 39 of them while requests_rejected_total read 0."""

    class NoDecodeWorker:
        async def place(self, request):
            raise WorkerUnavailable("no decode worker is available", retry_after_s=2.0)

    async def scenario() -> None:
        metrics = RouterMetrics("m")
        flow = RequestFlow(None, NoDecodeWorker(), SloConfig(), metrics, Tracing("test", "none"),  # type: ignore[arg-type]
                           30.0, 30.0, migration_wait_s=1.0)  # fmt: skip
        with pytest.raises(WorkerUnavailable):
            await anext(flow.generate("r", [1, 2, 3], SamplingParams(max_tokens=2)))
        value = metrics.registry.get_sample_value
        assert (
            value("tandem:requests_rejected_total", {"model_name": "m", "reason": "unavailable"})
            == 1
        )
        assert (
            value("tandem:requests_rejected_total", {"model_name": "m", "reason": "overloaded"})
            == 0
        )

    asyncio.run(scenario())

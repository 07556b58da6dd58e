"""A cluster behind its token: the router serves through it, and every internal call
without it is refused (UNAUTHENTICATED) and logged without request data. Health
probes stay open."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.config import EngineConfig
from tandem.kv_transfer.layout import KvLayout
from tandem.kv_transfer.tcp_channel import split_endpoint
from tandem.kv_transfer.wire import DataReply, Hello, recv_message, send_message
from tandem.proto.cluster_auth import ClusterAuth, generate_token, internal_channel
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.router.config import RouterConfig
from tandem.router.server import Router
from tandem.worker.config import WorkerRole
from tests.helpers.grpc_calls import generate_tokens, worker_stats
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.inproc_cluster import InprocCluster
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

AUTH = ClusterAuth(token=generate_token())
MAX_TOKENS = 8
# Every refusal line: the method and the peer, nothing from the request.
REFUSAL_LINE = re.compile(
    r"refused internal call /tandem\.worker\.v1\.\w+/\w+ from \S+: "
    r"(no|wrong) cluster token( \(\d+ more refused since the last report\))?"
)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[InprocCluster]:
    """1 prefill + 1 decode worker and a router, all with `AUTH` (checked idle after
    each test by the conftest fixture, through the token)."""
    cluster = InprocCluster(str(tiny_model_dir), cluster_auth=AUTH)
    cluster.start()
    yield cluster
    cluster.stop()


def _worker(cluster: InprocCluster, role: WorkerRole) -> str:
    return next(w.endpoint for w in cluster.workers if w.role is role)


def test_router_serves_through_the_token_and_kv_crosses_over_tcp(cluster, tiny_model_dir):
    prompts = make_prompts(2048, (40, 90), seed=5)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)
    got = cluster.run(generate_tokens(cluster.grpc_endpoint, prompts, MAX_TOKENS))
    assert got == expected
    decode = cluster.run(worker_stats(_worker(cluster, WorkerRole.DECODE), "decode", AUTH))
    # Every pull passed the TCP handshake: none fell back to local recompute.
    assert decode.num_kv_recomputes == 0


async def _internal_calls(endpoint_p: str, endpoint_d: str, auth: ClusterAuth | None) -> list:
    """Every internal RPC once; the status code of each (None = answered)."""

    def channel(endpoint: str) -> grpc.aio.Channel:
        if auth is None:
            return grpc.aio.insecure_channel(endpoint)
        return internal_channel(endpoint, auth)

    codes = []
    async with channel(endpoint_p) as p_channel, channel(endpoint_d) as d_channel:
        prefill = worker_pb2_grpc.PrefillWorkerStub(p_channel)
        decode = worker_pb2_grpc.DecodeWorkerStub(d_channel)
        kv = worker_pb2_grpc.KvTransferStub(p_channel)
        params = pb.SamplingParams(max_tokens=4, temperature=0.0)
        calls = [
            lambda: prefill.Prefill(
                pb.PrefillRequest(request_id="r-secret", prompt_token_ids=[7, 8, 9], params=params),
                timeout=30,
            ),
            lambda: prefill.Release(pb.ReleaseRequest(request_id="r-secret"), timeout=30),
            lambda: prefill.Stats(pb.StatsRequest(), timeout=30),
            lambda: decode.Abort(pb.AbortRequest(request_id="r-secret"), timeout=30),
            lambda: decode.Stats(pb.StatsRequest(), timeout=30),
            lambda: kv.OpenChannel(pb.OpenChannelRequest(decode_worker_id="d"), timeout=30),
        ]
        for call in calls:
            try:
                await call()
                codes.append(None)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
        # The one server stream: a local-prefill decode of a prompt.
        try:
            stream = decode.Decode(
                pb.DecodeRequest(
                    request_id="r-secret", prompt_token_ids=[7, 8, 9], params=params,
                    local_prefill=True,
                ),
                timeout=30,
            )  # fmt: skip
            async for _ in stream:
                pass
            codes.append(None)
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
    return codes


def refusal_count(cluster: InprocCluster, worker_id: str, kind: str) -> float:
    """The worker's `tandem:unauthenticated_requests_total` of `kind`."""
    url = f"{cluster.worker_metrics_endpoints[worker_id]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "tandem:unauthenticated_requests_total"
                and sample.labels.get("kind") == kind
            ):
                return sample.value
    return 0.0


def test_internal_calls_without_the_token_are_refused_and_logged_without_data(
    cluster, caplog: pytest.LogCaptureFixture
):
    p_endpoint = _worker(cluster, WorkerRole.PREFILL)
    d_endpoint = _worker(cluster, WorkerRole.DECODE)
    wrong = ClusterAuth(token=generate_token())
    before = {w: refusal_count(cluster, w, "grpc") for w in ("prefill-0", "decode-0")}
    with caplog.at_level(logging.WARNING):
        for auth in (None, wrong):
            codes = cluster.run(_internal_calls(p_endpoint, d_endpoint, auth))
            assert codes == [grpc.StatusCode.UNAUTHENTICATED] * len(codes), (auth, codes)
    # Each refusal counted: Prefill, Release, Stats, OpenChannel on the prefill worker,
    # Abort, Stats, Decode on the decode worker; twice (no token, wrong token).
    assert refusal_count(cluster, "prefill-0", "grpc") - before["prefill-0"] == 8
    assert refusal_count(cluster, "decode-0", "grpc") - before["decode-0"] == 6
    refusals = [r.getMessage() for r in caplog.records if "refused internal call" in r.message]
    # At least the first refusal of each worker (later ones fall in the rate limit).
    assert len(refusals) >= 2, caplog.text
    for line in refusals:
        assert REFUSAL_LINE.fullmatch(line), line
    assert "r-secret" not in caplog.text
    assert AUTH.token not in caplog.text and wrong.token not in caplog.text


def test_kv_data_connection_without_the_proof_is_refused_and_counted(cluster):
    p_endpoint = _worker(cluster, WorkerRole.PREFILL)
    before = refusal_count(cluster, "prefill-0", "kv_data")

    async def attack() -> DataReply:
        async with internal_channel(p_endpoint, AUTH) as channel:
            stub = worker_pb2_grpc.KvTransferStub(channel)
            opened = await stub.OpenChannel(
                pb.OpenChannelRequest(
                    decode_worker_id="intruder",
                    layout_fingerprint=KvLayout.from_engine_config(
                        EngineConfig(model=cluster.model_dir, max_model_len=1024)
                    ).fingerprint(),
                    backend=pb.KV_BACKEND_TCP,
                ),
                timeout=10,
            )
            try:
                return await asyncio.to_thread(_hello_without_proof, opened)
            finally:
                await stub.CloseChannel(
                    pb.CloseChannelRequest(channel_id=opened.channel_id), timeout=10
                )

    reply = cluster.run(attack())
    assert reply.status == "unauthenticated" and reply.nbytes == 0
    assert refusal_count(cluster, "prefill-0", "kv_data") - before == 1


def _hello_without_proof(opened: pb.OpenChannelResponse) -> DataReply:
    with socket.create_connection(split_endpoint(opened.tcp_endpoint), timeout=10) as sock:
        send_message(sock, Hello(opened.channel_id))
        reply = recv_message(sock, 10)
        assert isinstance(reply, DataReply)
        assert sock.recv(1) == b""  # closed by the worker
        return reply


def test_the_token_opens_every_internal_call(cluster):
    """The same calls with the token get past the guard (no UNAUTHENTICATED)."""
    p_endpoint = _worker(cluster, WorkerRole.PREFILL)
    d_endpoint = _worker(cluster, WorkerRole.DECODE)
    codes = cluster.run(_internal_calls(p_endpoint, d_endpoint, AUTH))
    # Prefill (then Release), Stats, Abort and the Decode stream are answered; the
    # OpenChannel without a layout reaches the service, which checks the layout.
    assert codes == [None] * 5 + [grpc.StatusCode.FAILED_PRECONDITION, None], codes


def test_health_probes_need_no_token(cluster):
    async def check(endpoint: str) -> int:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(), timeout=10
            )
            return reply.status

    for worker in cluster.workers:
        assert cluster.run(check(worker.endpoint)) == health_pb2.HealthCheckResponse.SERVING


def test_router_with_another_token_cannot_use_the_workers(cluster, tiny_model_dir):
    config = RouterConfig(
        model_dir=str(tiny_model_dir), grpc_port=0, http_port=0, warmup_profile=False,
        cluster_auth=ClusterAuth(token=generate_token()),
    )  # fmt: skip

    async def start_and_stop() -> grpc.StatusCode | None:
        router = Router(config, cluster.workers)  # on the loop its channels will use
        try:
            await asyncio.wait_for(router.start(), 60)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await router.stop()
        return None

    assert cluster.run(start_and_stop()) == grpc.StatusCode.UNAUTHENTICATED

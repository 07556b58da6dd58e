"""Internal gRPC over mutual TLS (with the cluster token on top): the cluster serves,
and a client without the cluster's certificate, or with a certificate of another CA,
or without the token, gets nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.proto.cluster_auth import ClusterAuth, InternalTls, generate_token, internal_channel
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.worker.config import WorkerRole
from tests.helpers.grpc_calls import generate_tokens, worker_stats
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.inproc_cluster import InprocCluster
from tests.helpers.prompts import make_prompts
from tests.helpers.tls_certs import have_openssl, make_ca, make_cert

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not have_openssl(), reason="needs the openssl CLI to make certificates"),
]

SERVER_NAME = "tandem.internal"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tls")


@pytest.fixture(scope="module")
def auth(certs: Path) -> ClusterAuth:
    # The certificate names the cluster, not an address: clients check SERVER_NAME.
    files = make_cert(certs, make_ca(certs / "ca"), "node", [SERVER_NAME])
    tls = InternalTls(str(files.cert), str(files.key), str(files.ca), server_name=SERVER_NAME)
    return ClusterAuth(token=generate_token(), tls=tls)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, auth: ClusterAuth) -> Iterator[InprocCluster]:
    cluster = InprocCluster(str(tiny_model_dir), cluster_auth=auth)
    cluster.start()
    yield cluster
    cluster.stop()


def _prefill(cluster: InprocCluster) -> str:
    return next(w.endpoint for w in cluster.workers if w.role is WorkerRole.PREFILL)


async def _stats_code(endpoint: str, auth: ClusterAuth) -> grpc.StatusCode | None:
    """Stats over a channel made here (on the cluster's loop, as grpc.aio wants)."""
    async with internal_channel(endpoint, auth) as channel:
        try:
            await worker_pb2_grpc.PrefillWorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return None


def test_cluster_serves_over_mutual_tls(cluster, auth, tiny_model_dir):
    prompts = make_prompts(2048, (30, 70), seed=9)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)
    assert cluster.run(generate_tokens(cluster.grpc_endpoint, prompts, MAX_TOKENS)) == expected
    decode = next(w.endpoint for w in cluster.workers if w.role is WorkerRole.DECODE)
    stats = cluster.run(worker_stats(decode, "decode", auth))
    assert stats.num_kv_recomputes == 0


def test_plaintext_client_gets_nothing_even_with_the_token(cluster, auth):
    plain = ClusterAuth(token=auth.token)
    code = cluster.run(_stats_code(_prefill(cluster), plain))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_certificate_of_another_ca_is_refused(cluster, auth, certs):
    files = make_cert(certs, make_ca(certs / "rogue-ca", "rogue-ca"), "rogue", [SERVER_NAME])
    rogue = ClusterAuth(
        token=auth.token,
        tls=InternalTls(str(files.cert), str(files.key), str(files.ca), server_name=SERVER_NAME),
    )
    assert cluster.run(_stats_code(_prefill(cluster), rogue)) == grpc.StatusCode.UNAVAILABLE
    # The cluster's own CA with the rogue client certificate: the server refuses it.
    mixed = ClusterAuth(
        token=auth.token,
        tls=InternalTls(str(files.cert), str(files.key), auth.tls.ca_file, SERVER_NAME),
    )
    assert cluster.run(_stats_code(_prefill(cluster), mixed)) == grpc.StatusCode.UNAVAILABLE


def test_tls_without_the_token_is_unauthenticated(cluster, auth):
    no_token = ClusterAuth(tls=auth.tls)
    code = cluster.run(_stats_code(_prefill(cluster), no_token))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert cluster.run(_stats_code(_prefill(cluster), auth)) is None


def test_clients_check_the_server_name(cluster, auth):
    """Without the name override the client checks 127.0.0.1, which the cert lacks."""
    unnamed = ClusterAuth(
        token=auth.token,
        tls=InternalTls(auth.tls.cert_file, auth.tls.key_file, auth.tls.ca_file),
    )
    code = cluster.run(_stats_code(_prefill(cluster), unnamed))
    assert code == grpc.StatusCode.UNAVAILABLE

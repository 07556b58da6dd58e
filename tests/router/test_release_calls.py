"""A disaggregated request's prompt KV is unpinned once: by the decode worker after its
pull. The router unpins only when the decode side may never have pulled (tested with
cancels in test_cancel.py); a stream closed after its last chunk used to send a second
Release, which on a prefill worker in the middle of a long step held the reply for the
router's 5 s release timeout."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from tandem.prefill_worker.service import PrefillService
from tests.helpers.grpc_calls import generate_tokens
from tests.helpers.inproc_cluster import InprocCluster, inproc_router_config
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)


def test_each_finished_request_is_released_once(tiny_model_dir, monkeypatch):
    releases: collections.Counter[str] = collections.Counter()
    release = PrefillService.Release

    async def counted(self, request, context):
        releases[request.request_id] += 1
        return await release(self, request, context)

    # Before the cluster starts: the server binds its handlers then.
    monkeypatch.setattr(PrefillService, "Release", counted)
    # Every prompt through the prefill worker (none prefilled by the decode worker).
    config = dataclasses.replace(
        inproc_router_config(str(tiny_model_dir)), max_local_prefill_tokens=0
    )
    cluster = InprocCluster(str(tiny_model_dir), router_config=config).start()
    try:
        prompts = make_prompts(2048, (30, 45, 60), seed=17)
        outputs = cluster.run(generate_tokens(cluster.grpc_endpoint, prompts, max_tokens=6))
        assert [len(tokens) for tokens in outputs] == [6, 6, 6]
        cluster.assert_idle()
        assert len(releases) == len(prompts) and set(releases.values()) == {1}, releases
    finally:
        cluster.stop()

"""`tandem pools` and `tandem scale` against a running cluster on real Ray (`tandem router`:
`test_routers.py`)."""

from __future__ import annotations

import asyncio
import json

import pytest
import ray

from tandem.cluster.cli import main
from tandem.cluster.launcher import LocalCluster
from tandem.router.membership import PoolTargets
from tests.helpers.parallel import DISRUPTS_ITS_CLUSTER
from tests.helpers.ray_pools import assert_idle, cluster_config, init_ray_with_role_slots

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow, DISRUPTS_ITS_CLUSTER]


@pytest.fixture(scope="module")
def ray_session():
    init_ray_with_role_slots()
    yield
    ray.shutdown()


def cli(*argv: str) -> int:
    return main(list(argv))


def test_pools_and_scale_commands_through_the_controller(ray_session, tiny_model_dir, capsys):
    async def scenario() -> None:
        cluster = LocalCluster(cluster_config(tiny_model_dir))
        try:
            await cluster.start()
            address = cluster.ray_address
            assert await asyncio.to_thread(cli, "pools", "--ray-address", address) == 0
            table = capsys.readouterr().out
            assert "prefill-0" in table and "decode-0" in table and "serving" in table
            assert table.rstrip().endswith("targets: prefill 1, decode 1")

            # Refused: the reason names the field; exit 2; nothing changes.
            rc = await asyncio.to_thread(
                cli, "scale", "--prefill", "1", "--decode", "5", "--ray-address", address
            )
            assert rc == 2
            assert "decode: 5 workers is over the budget" in capsys.readouterr().err
            assert (await cluster.membership()).targets == PoolTargets(1, 1)

            # Up: returns 0 once both decode workers serve.
            rc = await asyncio.to_thread(
                cli, "scale", "--prefill", "1", "--decode", "2", "--ray-address", address,
                "--timeout", "120",
            )  # fmt: skip
            assert rc == 0, capsys.readouterr().err
            assert "pools at target: prefill 1, decode 2" in capsys.readouterr().out
            assert await asyncio.to_thread(cli, "pools", "--ray-address", address, "--json") == 0
            view = json.loads(capsys.readouterr().out)
            assert view["targets"] == {"prefill": 1, "decode": 2}
            states = sorted((w["role"], w["state"]) for w in view["workers"])
            assert states == [("decode", "serving")] * 2 + [("prefill", "serving")]
            assert all(w["pid"] > 0 and w["endpoint"] for w in view["workers"])
            # The test clusters give every worker --threads 1.
            assert [w["threads"] for w in view["workers"]] == [1, 1, 1]

            # Drain one worker through the router's HTTP admin API: returns 0 once it
            # stopped; the target stays, so a replacement starts. Unknown: exit 2.
            http = cluster.router.http_endpoint
            rc = await asyncio.to_thread(cli, "drain", "--worker", "decode-9", "--address", http)
            assert rc == 2
            assert "no worker 'decode-9' in the pools" in capsys.readouterr().err
            rc = await asyncio.to_thread(
                cli, "drain", "--worker", "decode-1", "--address", http, "--timeout", "120"
            )
            assert rc == 0, capsys.readouterr().err
            assert capsys.readouterr().out == "worker decode-1: drained and stopped: decode-1\n"
            refilled = await cluster.controller.wait_at_target.remote(120.0)
            ids = sorted(w.worker_id for w in refilled.workers)
            assert ids == ["decode-0", "decode-2", "prefill-0"]

            # Too short a timeout for a worker to start: exit 1, saying which role is short.
            rc = await asyncio.to_thread(
                cli, "scale", "--prefill", "1", "--decode", "3", "--ray-address", address,
                "--timeout", "0.5",
            )  # fmt: skip
            assert rc == 1
            assert "timed out after 0.5 s: decode 2/3 serving, 1 starting" in (
                capsys.readouterr().err
            )
            await cluster.controller.wait_at_target.remote(120.0)

            # Down: returns 0 once the surplus workers drained and stopped.
            rc = await asyncio.to_thread(
                cli, "scale", "--prefill", "1", "--decode", "1", "--ray-address", address,
                "--timeout", "120",
            )  # fmt: skip
            assert rc == 0, capsys.readouterr().err
            assert len((await cluster.membership()).workers) == 2
            await assert_idle(
                await cluster.controller.wait_at_target.remote(120.0),
                auth=cluster.config.worker.cluster_auth,
            )
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def test_a_malformed_admin_address_is_one_line(capsys):
    assert cli("pools", "--address", "http://[::1") == 1
    assert capsys.readouterr().err == (
        "tandem pools: http://[::1: not a usable address: Invalid IPv6 URL\n"
    )


_LONG_OUTPUT = """
import argparse, sys
from tandem.cluster import cli

def handler(args):
    for i in range(100_000):
        print("worker", i)
    return 0

parser = argparse.ArgumentParser()
parser.add_argument("-v", "--verbose", action="store_true")
parser.set_defaults(handler=handler)
cli.build_parser = lambda: parser
sys.exit(cli.main([]))
"""


@pytest.mark.timeout(60)
def test_output_piped_into_a_reader_that_leaves_ends_quietly():
    """`tandem pools | head`: the reader leaves early; a traceback (BrokenPipeError) was
    printed. Now the command ends as one killed by SIGPIPE does: no output on stderr."""
    import subprocess
    import sys

    command = subprocess.Popen([sys.executable, "-c", _LONG_OUTPUT], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)  # fmt: skip
    assert command.stdout is not None and command.stdout.readline() == b"worker 0\n"
    command.stdout.close()
    _, stderr = command.communicate(timeout=30)
    assert (command.returncode, stderr) == (141, b"")


def test_a_scale_replaced_by_another_before_it_landed_is_not_reported_as_done():
    """`tandem scale 2 2` overlapped by `tandem scale 1 1` (or the planner) printed "pools
    at target: prefill 1, decode 1" and exited 0; now it says what replaced it."""
    from tandem.cluster.pool_commands import scale_pending

    worker = {"role": "decode", "state": "serving"}
    view = {"targets": {"prefill": 1, "decode": 1},
            "workers": [worker, {"role": "prefill", "state": "serving"}]}  # fmt: skip
    assert scale_pending(view, 1, 1) == ""
    with pytest.raises(RuntimeError, match=r"changed to prefill 1, decode 1 .* before these"):
        scale_pending(view, 2, 2)
    growing = {**view, "targets": {"prefill": 1, "decode": 2}}
    assert scale_pending(growing, 1, 2) == "decode 1/2 serving"

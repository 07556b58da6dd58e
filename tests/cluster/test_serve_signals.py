"""`tandem serve` stopped by SIGTERM (what Kubernetes, systemd and `docker stop` send):
the streams in flight finish, then it exits 0 and leaves no process of its session
behind (Ray's own handler used to take SIGTERM in the driver: every stream cut, a
segfault, Ray left running)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from tests.helpers.grpc_calls import stream_tokens, wait_streaming
from tests.helpers.parallel import DISRUPTS_ITS_CLUSTER
from tests.helpers.prompts import make_prompts
from tests.helpers.tandem_command import TandemCommand

pytestmark = [pytest.mark.timeout(300), DISRUPTS_ITS_CLUSTER]

MAX_TOKENS = 400


def test_sigterm_lets_streams_finish_then_exits(tiny_model_dir, tmp_path):
    serve = TandemCommand(
        "serve", tmp_path / "serve.log", "--model", str(tiny_model_dir), "--device", "cpu",
        "--threads", "1", "--planner", "off",
    )  # fmt: skip
    try:
        serve.wait_ready(180)
        prompts = make_prompts(2048, (20, 35, 50), seed=80)
        ids = [f"s{i}" for i in range(len(prompts))]

        async def scenario() -> tuple[list[tuple[list[int], str]], int]:
            progress: dict[str, int] = {}
            tasks = [
                asyncio.ensure_future(
                    stream_tokens(serve.grpc_endpoint, rid, p, progress, max_tokens=MAX_TOKENS)
                )
                for rid, p in zip(ids, prompts, strict=True)
            ]
            await wait_streaming(progress, ids)
            loop = asyncio.get_running_loop()
            code = await loop.run_in_executor(None, serve.stop, 120.0, signal.SIGTERM)
            return list(await asyncio.gather(*tasks)), code

        results, code = asyncio.run(scenario())
        assert [len(tokens) for tokens, _ in results] == [MAX_TOKENS] * len(prompts)
        assert code == 0, serve.output[-3000:]
        assert "stopping: draining requests" in serve.output
        assert "SIGTERM received" not in serve.output
        assert serve.session_pids() == [], "left running (Ray's daemons?)"
    finally:
        serve.stop()  # nothing to do once it exited
        serve.kill_session()

"""The process harness: servers started, awaited, and stopped with their whole process
group (real processes, a stand-in OpenAI `/v1/models` server); worker endpoints read
from a `tandem serve`-style announcement; CPU time read from /proc."""

from __future__ import annotations

import os
import sys
import urllib.request

import pytest

from tandem.bench.harness import ServerSpec, free_port, process_cpu_s, running, tandem_spec

pytestmark = pytest.mark.timeout(60)

# Serves GET /v1/models on argv[1] and starts a child that would outlive it if the group
# were not stopped; the child's pid goes to argv[2].
FAKE_SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "w").write(str(child.pid))
class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"data": [{"id": "m"}]}'
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Models).serve_forever()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_servers_start_answer_and_stop_with_their_children(tmp_path):
    port, pid_file = free_port(), tmp_path / "child.pid"
    spec = ServerSpec(
        "fake server",
        (sys.executable, "-c", FAKE_SERVER, str(port), str(pid_file)),
        f"http://127.0.0.1:{port}/v1/models",
        http_url=f"http://127.0.0.1:{port}",
    )
    with running([spec], tmp_path / "logs") as servers:
        assert [s.spec for s in servers] == [spec]
        assert alive(servers[0].pid)
        with urllib.request.urlopen(f"{spec.http_url}/v1/models", timeout=5) as reply:
            assert reply.status == 200
        child = int(pid_file.read_text())
        assert alive(child)
    assert not alive(child)
    assert (tmp_path / "logs" / "fake-server.log").is_file()


def test_a_server_that_dies_at_start_names_its_log(tmp_path):
    spec = ServerSpec("broken", (sys.executable, "-c", "raise SystemExit(3)"), "http://127.0.0.1:9")
    with (
        pytest.raises(RuntimeError, match=r"exited with 3; see .*broken\.log"),
        running([spec], tmp_path),
    ):
        pass


# Prints what `tandem serve` announces, then listens on argv[1] (a TCP readiness check).
ANNOUNCER = """
import socket, sys, time
print("Tandem serving m")
print("  prefill   prefill-0    127.0.0.1:4001")
print("  decode    decode-0     127.0.0.1:4002")
listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
time.sleep(600)
"""


def test_tcp_readiness_and_announced_worker_endpoints(tmp_path):
    port = free_port()
    argv = (sys.executable, "-u", "-c", ANNOUNCER, str(port))
    spec = ServerSpec("announcer", argv, f"tcp://127.0.0.1:{port}", cores=(0,))
    with running([spec], tmp_path) as (server,):
        assert server.worker_endpoints(timeout_s=10) == {
            "prefill": "127.0.0.1:4001",
            "decode": "127.0.0.1:4002",
        }


def test_tandem_spec_is_a_tandem_serve_command_line():
    spec = tandem_spec("t", "models/m", 5001, 5002, ("--prefill", "1"))
    assert spec.argv[1:] == (
        "-m", "tandem.cluster.cli", "serve", "--model", "models/m",
        "--grpc-port", "5001", "--http-port", "5002", "--prefill", "1",
    )  # fmt: skip
    assert spec.ready == "http://127.0.0.1:5002/v1/models"
    assert spec.grpc_target == "grpc://127.0.0.1:5001"


def test_process_cpu_s_reads_proc():
    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        pytest.skip("no /proc")
    assert process_cpu_s(os.getpid()) >= 0.0
    assert process_cpu_s(2**22 + 7) is None  # above Linux's largest pid_max

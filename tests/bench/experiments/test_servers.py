"""Server processes of the experiments: started, awaited, and stopped with their whole
process group (real processes, a stand-in OpenAI `/v1/models` server)."""

from __future__ import annotations

import os
import socket
import sys
import urllib.request

import pytest

from tandem.bench.experiments.servers import ServerSpec, running

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        f"http://127.0.0.1:{port}",
    )
    with running([spec], tmp_path / "logs") as specs:
        assert specs == [spec]
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

"""A real Prometheus server (Debian's `prometheus` binary) for tests: scrapes the given
targets every second, evaluates rule files, and answers PromQL over its HTTP API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ScrapeJob:
    name: str
    # http://host:port/path URLs; each job's targets must share one path.
    urls: list[str]
    # Static target labels, as the chart's ServiceMonitor/PodMonitor would add them.
    labels: dict[str, str]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrometheusServer:
    """Owns one `prometheus` process and its data folder under `workdir`."""

    def __init__(self, workdir: Path, jobs: list[ScrapeJob], rule_files: list[Path]) -> None:
        self.workdir = workdir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        scrape_configs = []
        for job in jobs:
            paths = {urllib.parse.urlsplit(u).path or "/metrics" for u in job.urls}
            assert len(paths) == 1, f"{job.name}: targets with different paths {paths}"
            scrape_configs.append({
                "job_name": job.name,
                "metrics_path": paths.pop(),
                "static_configs": [{
                    "targets": [urllib.parse.urlsplit(u).netloc for u in job.urls],
                    "labels": job.labels,
                }],
            })  # fmt: skip
        config = {
            "global": {
                "scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s",
            },
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": scrape_configs,
        }  # fmt: skip
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))

    def start(self, timeout_s: float = 30.0) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed"
        self.process = subprocess.Popen(
            [binary, f"--config.file={self.config_path}",
             f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=(self.workdir / "prometheus.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "prometheus.log").read_text()
                raise AssertionError(f"prometheus did not become ready:\n{log}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            self.process = None

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; the `data` of a success answer."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query now; the result vector (empty = no data)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def wait_for(self, expr: str, timeout_s: float, what: str) -> list[dict[str, Any]]:
        """Poll `expr` until it returns a sample."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
            time.sleep(0.5)

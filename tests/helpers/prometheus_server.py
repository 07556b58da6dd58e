"""A real Prometheus server (Debian's `prometheus` binary) for tests: scrapes its jobs'
targets every second, evaluates rule files, and answers PromQL over its HTTP API.

Targets come from files (`file_sd`), so the server can start before the cluster it will
scrape: Prometheus applies new targets only every few seconds, and that wait then
overlaps the cluster's start.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tandem.bench.harness import free_port


class PrometheusServer:
    """Owns one `prometheus` process and its files under `workdir`. Every job scrapes
    `/metrics` of the targets `set_targets` gives it."""

    def __init__(self, workdir: Path, job_names: list[str], rule_files: list[Path]) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        scrape_configs = [
            {
                "job_name": name,
                "metrics_path": "/metrics",
                # As the chart's monitors: a target's `model_name` labels the series that
                # lack one (pool and planner gauges) and leaves the routers' own alone.
                "honor_labels": True,
                "file_sd_configs": [
                    {"files": [str(self._targets_file(name))], "refresh_interval": "1s"}
                ],
            }
            for name in job_names
        ]
        config = {
            "global": {
                "scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s",
            },
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": scrape_configs,
        }  # fmt: skip
        for name in job_names:
            self._targets_file(name).write_text("[]")
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))

    def _targets_file(self, job: str) -> Path:
        return self.workdir / f"targets-{job}.json"

    def set_targets(self, job: str, urls: list[str], labels: dict[str, str]) -> None:
        """Scrape `urls` (http://host:port/metrics) in `job`, with static `labels` (as the
        chart's ServiceMonitor/PodMonitor would add them)."""
        for url in urls:
            assert urllib.parse.urlsplit(url).path == "/metrics", url
        groups = [{"targets": [urllib.parse.urlsplit(u).netloc for u in urls], "labels": labels}]
        staged = self.workdir / f".{job}.json"
        staged.write_text(json.dumps(groups))
        staged.replace(self._targets_file(job))  # atomic: Prometheus never reads half a file

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
                self.stop()
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
                raise AssertionError(
                    f"timed out after {timeout_s:g} s waiting for {what}; targets: "
                    f"{self.target_health()}"
                )
            time.sleep(0.25)

    def target_health(self) -> list[str]:
        """`scrape URL: health (last error)` of every active target."""
        return [
            f"{t['scrapeUrl']}: {t['health']} {t['lastError']}".strip()
            for t in self.api("targets")["activeTargets"]
        ]

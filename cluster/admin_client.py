"""Clients of the pools admin API for `tandem pools` / `tandem scale` / `tandem drain`.

Two ways in, one answer shape (the JSON of `GET /admin/pools`):
- `HttpAdminClient`: a router's HTTP admin API (`GET /admin/pools`, `POST /admin/scale`,
  `POST /admin/drain`), with the router's API key when it has one;
- `RayAdminClient`: straight to the pool controller of a Ray cluster (for an operator
  with Ray access, or a node's own stop hook; no router needed). Only it drains a Ray
  node (`drain_node`).
Both raise `AdminRefused` (a 4xx/5xx or a controller refusal, with its reason) or
`AdminUnreachable` (nothing answered, or a 503: the router answered, its pool controller
did not).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, Protocol

from tandem.router.admin import restart_holds_json
from tandem.router.membership import Membership, PoolTargets

PoolsView = dict[str, Any]


class AdminRefused(Exception):
    """The admin API answered with a refusal (bad input, cannot be done now)."""


class AdminUnreachable(Exception):
    """Nothing answered at the admin address."""


def membership_json(membership: Membership) -> PoolsView:
    """`GET /admin/pools`'s body for a membership snapshot."""
    workers = [
        {
            "id": w.worker_id,
            "role": w.role.value,
            "state": w.state.value,
            "node": w.node,
            "pid": w.pid,
            "threads": w.threads,
            "endpoint": w.endpoint,
            "metrics_url": w.metrics_url,
            "running": w.running,
            "waiting": w.waiting,
            "kv_usage": w.kv_usage,
            "being_replaced": w.being_replaced,
        }
        for w in membership.workers
    ]
    targets = membership.targets
    view: PoolsView = {"workers": workers, "targets": {}, "version": membership.version,
                       "owner": membership.owner,
                       "restart_holds": restart_holds_json(membership)}  # fmt: skip
    if targets is not None:
        view["targets"] = {"prefill": targets.prefill, "decode": targets.decode}
    return view


class AdminClient(Protocol):
    def get_pools(self) -> PoolsView: ...

    def scale(self, prefill: int, decode: int) -> PoolsView: ...

    def drain(self, worker_id: str) -> PoolsView: ...


class HttpAdminClient:
    """A router's HTTP admin API at host:port."""

    def __init__(self, address: str, api_key: str | None, timeout_s: float = 10.0) -> None:
        self.base = address if "://" in address else f"http://{address}"
        self.api_key = api_key
        self.timeout_s = timeout_s

    def get_pools(self) -> PoolsView:
        return self._request("GET", "/admin/pools", None)

    def scale(self, prefill: int, decode: int) -> PoolsView:
        return self._request("POST", "/admin/scale", {"prefill": prefill, "decode": decode})

    def drain(self, worker_id: str) -> PoolsView:
        return self._request("POST", "/admin/drain", {"worker_id": worker_id})

    def _request(self, method: str, path: str, body: dict | None) -> PoolsView:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        try:
            request = urllib.request.Request(self.base + path, data, headers, method=method)
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            message = f"{exc.code}: {_error_message(exc.read())}"
            if exc.code == 503:  # the router is up, its pool controller is not
                raise AdminUnreachable(message) from None
            raise AdminRefused(message) from None
        except (urllib.error.URLError, OSError) as exc:
            raise AdminUnreachable(f"{self.base}: {exc}") from None
        except (ValueError, http.client.InvalidURL) as exc:  # a malformed --address
            raise AdminUnreachable(f"{self.base}: not a usable address: {exc}") from None


def _error_message(body: bytes) -> str:
    """The reason in an error reply (OpenAI-style `{"error": {"message"}}` or text)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip() or "(no reason given)"
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


class RayAdminClient:
    """The pool controller of the Ray cluster this process joined (sync calls)."""

    def __init__(self, controller: Any, timeout_s: float = 30.0) -> None:
        self.controller = controller
        self.timeout_s = timeout_s

    def get_pools(self) -> PoolsView:
        return membership_json(self._get(self.controller.get_membership.remote()))

    def scale(self, prefill: int, decode: int) -> PoolsView:
        try:
            targets = PoolTargets(prefill=prefill, decode=decode)
        except ValueError as exc:
            raise AdminRefused(str(exc)) from None
        return membership_json(self._get(self.controller.scale.remote(targets)))

    def drain(self, worker_id: str) -> PoolsView:
        return membership_json(self._get(self.controller.drain.remote(worker_id)))

    def drain_node(self, node_id: str, deadline_s: float) -> PoolsView:
        return membership_json(self._get(self.controller.drain_node.remote(node_id, deadline_s)))

    @staticmethod
    def this_node() -> str:
        """The Ray node this process runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    @staticmethod
    def resolve_node(prefix: str) -> str:
        """The alive Ray node whose id starts with `prefix`; AdminRefused unless one does."""
        from tandem.cluster.ray_nodes import resolve_node_id

        try:
            return resolve_node_id(prefix)
        except ValueError as exc:
            raise AdminRefused(str(exc)) from None

    def _get(self, ref: Any) -> Membership:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as exc:
            raise AdminRefused(str(exc.cause)) from None
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
            raise AdminUnreachable(f"pool controller: {exc}") from None


def at_targets(view: PoolsView) -> bool:
    """Serving workers match the targets, and nothing is starting or draining."""
    return not shortfall(view)


def shortfall(view: PoolsView) -> str:
    """What keeps `view` from its targets ("" when it is there)."""
    gaps = []
    for role, target in view.get("targets", {}).items():
        states = [w["state"] for w in view["workers"] if w["role"] == role]
        serving = states.count("serving")
        busy = {s: states.count(s) for s in ("starting", "draining") if states.count(s)}
        if serving != target or busy:
            extra = "".join(f", {n} {s}" for s, n in busy.items())
            gaps.append(f"{role} {serving}/{target} serving{extra}")
    return "; ".join(gaps)


def still_running(view: PoolsView, worker_id: str | None = None, node: str | None = None
                  ) -> list[dict[str, Any]]:  # fmt: skip
    """The workers of `view` that are the one named or on the node named and not yet
    stopped (a dead one is stopped: its requests moved on)."""
    return [
        w for w in view["workers"]
        if w["state"] != "dead" and (w["id"] == worker_id or (node and w["node"] == node))
    ]  # fmt: skip


def _milliseconds(seconds: float | None) -> str:
    """A router's prediction for the table: "" where there is none (0: no model yet, a
    prefill worker's step, or a view read from the pool controller, which has none)."""
    return f"{seconds * 1e3:.1f}" if seconds else ""


def format_table(view: PoolsView) -> str:
    """`tandem pools`'s table."""
    columns = ("id", "role", "state", "node", "pid", "threads", "endpoint", "running", "waiting",
               "kv_usage", "step_ms", "queue_ms")  # fmt: skip
    rows: list[tuple[str, ...]] = [columns]
    for w in sorted(view["workers"], key=lambda w: (w["role"], w["id"])):
        state = w["state"] + (" (being replaced)" if w.get("being_replaced") else "")
        row = dict(w, state=state, node=str(w.get("node", ""))[:12],
                   kv_usage=f"{w.get('kv_usage', 0):.0%}",
                   step_ms=_milliseconds(w.get("predicted_step_s")),
                   queue_ms=_milliseconds(w.get("predicted_queue_s")))  # fmt: skip
        rows.append(tuple(str(row.get(c, "")) for c in columns))
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip()
             for r in rows]  # fmt: skip
    targets = view.get("targets") or {}
    if targets:
        lines.append("targets: " + ", ".join(f"{role} {n}" for role, n in targets.items()))
    for role, hold in sorted((view.get("restart_holds") or {}).items()):
        lines.append(f"{role}: next start held {hold['seconds_left']:.0f} s more (restart "
                     f"backoff: {hold['failures']} died young in a row)")  # fmt: skip
    return "\n".join(lines)

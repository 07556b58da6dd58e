"""`tandem pools`, `tandem scale`, `tandem drain` and `tandem router`: operating a
running cluster.

    tandem pools [--address HOST:PORT | --ray-address ADDR] [--json]
    tandem scale --prefill N --decode M [--address HOST:PORT | --ray-address ADDR] [--timeout S]
    tandem drain --worker ID [--address HOST:PORT | --ray-address ADDR] [--timeout S]
    tandem drain (--node NODE_ID | --this-node) --ray-address ADDR [--timeout S]
    tandem router --ray-address ADDR [--grpc-port P] [--http-port P] [--host H]

`--address` is a router's HTTP address (its admin API, with TANDEM_API_KEY / --api-key
when the router wants one); `--ray-address` goes straight to the cluster's pool
controller. `tandem scale` returns 0 once the serving workers match the targets, 1
on timeout (saying which role is short) or when the router or its pool controller does
not answer, and 2 when the change is refused (with the reason). `tandem drain` returns
0 once the workers it drains have stopped (their requests finished, replacements
started elsewhere), 1 on timeout (naming those still running) or no answer, 2 when
refused; `--this-node` is what a Ray node's own stop hook runs (the
Helm chart's worker pods on SIGTERM). Heavy imports stay inside the handlers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.cluster.admin_client import PoolsView

DEFAULT_ADMIN_ADDRESS = "127.0.0.1:8000"
EXIT_TIMEOUT = 1
EXIT_REFUSED = 2


def add_pool_commands(commands: argparse._SubParsersAction) -> None:
    from tandem.cluster.cli import non_empty, port, positive_float, positive_int

    pools = commands.add_parser("pools", help="list the workers of a running cluster")
    _add_address(pools)
    pools.add_argument("--json", action="store_true", help="print the admin JSON instead")
    pools.set_defaults(handler=_run_pools)

    scale = commands.add_parser(
        "scale", help="set the prefill/decode pool sizes and wait until they serve"
    )
    _add_address(scale)
    scale.add_argument("--prefill", type=positive_int, required=True, help="prefill workers")
    scale.add_argument("--decode", type=positive_int, required=True, help="decode workers")
    scale.add_argument(
        "--timeout", type=positive_float, default=300.0,
        help="longest wait for the pools to match, s [300]",
    )  # fmt: skip
    scale.set_defaults(handler=_run_scale)

    drain = commands.add_parser(
        "drain", help="drain a worker, or every worker on a Ray node, and wait until they stop"
    )
    _add_address(drain)
    which = drain.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--worker", type=non_empty, default=None, help="a worker id (see `tandem pools`)"
    )
    which.add_argument(
        "--node", type=non_empty, default=None,
        help="a Ray node id, or its start as `tandem pools` shows it: drain its workers and "
        "keep new ones off it (with --ray-address)",
    )  # fmt: skip
    which.add_argument(
        "--this-node", action="store_true",
        help="the Ray node this command runs on, as --node (with --ray-address)",
    )  # fmt: skip
    drain.add_argument(
        "--timeout", type=positive_float, default=300.0,
        help="longest wait for the workers to stop, s; a node's deadline for Ray [300]",
    )  # fmt: skip
    drain.set_defaults(handler=_run_drain)

    router = commands.add_parser(
        "router", help="start one more router for a running cluster (joins its Ray cluster)"
    )
    router.add_argument("--ray-address", required=True, help="the cluster's Ray address")
    # Left out, each takes `tandem serve`'s value (the cluster's router config).
    router.add_argument("--host", default=None, help="address the servers bind [tandem serve's]")
    router.add_argument(
        "--grpc-port", type=port, default=None, help="public gRPC port [tandem serve's]"
    )
    router.add_argument("--http-port", type=port, default=None, help="HTTP port [tandem serve's]")
    router.add_argument(
        "--api-key", default=None,
        help="require this key instead (or TANDEM_API_KEY) [tandem serve's key, if it has one]",
    )  # fmt: skip
    router.set_defaults(handler=_run_router)


def _add_address(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--address", default=None,
        help=f"a router's HTTP address, host:port [{DEFAULT_ADMIN_ADDRESS}]",
    )  # fmt: skip
    where.add_argument(
        "--ray-address", default=None, help="ask the pool controller on this Ray cluster"
    )
    parser.add_argument("--api-key", default=None, help="the router's API key (or TANDEM_API_KEY)")


def ray_auth_env() -> None:
    """Send the Ray cluster's auth token when joining it, if there is one.

    Recent Ray versions start a local cluster with token auth (the token in
    ~/.ray/auth_token), and a joining process sends the token only when RAY_AUTH_MODE
    says so, read when `ray` is imported: so this runs before that import, and only
    when nobody chose a mode.
    """
    from pathlib import Path

    if "ray" in sys.modules or "RAY_AUTH_MODE" in os.environ:
        return
    token_file = Path.home() / ".ray" / "auth_token"
    if (
        os.environ.get("RAY_AUTH_TOKEN")
        or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or (token_file.is_file())
    ):
        os.environ["RAY_AUTH_MODE"] = "token"


def _client(args: argparse.Namespace):
    from tandem.cluster.admin_client import AdminUnreachable, HttpAdminClient, RayAdminClient

    if args.ray_address:
        ray_auth_env()
        from tandem.cluster.controller_link import find_controller
        from tandem.cluster.ray_start import join_ray

        try:
            join_ray(args.ray_address)
        except ConnectionError as exc:
            raise AdminUnreachable(str(exc)) from None
        return RayAdminClient(find_controller())
    api_key = args.api_key or os.environ.get("TANDEM_API_KEY") or None
    return HttpAdminClient(args.address or DEFAULT_ADMIN_ADDRESS, api_key)


def _run_pools(args: argparse.Namespace) -> int:
    import json

    from tandem.cluster.admin_client import AdminRefused, AdminUnreachable, format_table

    try:
        view = _client(args).get_pools()
    except (AdminRefused, AdminUnreachable, RuntimeError) as exc:
        print(f"tandem pools: {exc}", file=sys.stderr)
        return EXIT_REFUSED if isinstance(exc, AdminRefused) else EXIT_TIMEOUT
    print(json.dumps(view, indent=2) if args.json else format_table(view))
    if not args.json and view.get("planner"):
        print(planner_line(view["planner"]))
    return 0


def planner_line(planner: dict) -> str:
    """The live planner's recommendation under the table (`"planner"` of /admin/pools)."""
    best = planner.get("recommended")
    head = f"planner ({planner.get('mode')}): "
    if not best:
        return head + f"no recommendation yet ({planner.get('last_action')})"
    return (f"{head}recommends {best['prefill']} prefill + {best['decode']} decode of "
            f"{planner.get('budget')} workers; {planner.get('reason')} "
            f"[last action: {planner.get('last_action')}]")  # fmt: skip


def _run_scale(args: argparse.Namespace) -> int:
    def change(client) -> PoolsView:
        return client.scale(args.prefill, args.decode)

    def pending(view: PoolsView) -> str:
        return scale_pending(view, args.prefill, args.decode)

    code, view = _change_then_wait("scale", args, change, pending)
    if code == 0:
        targets = view["targets"]
        print(f"pools at target: prefill {targets['prefill']}, decode {targets['decode']}")
    return code


def scale_pending(view: PoolsView, prefill: int, decode: int) -> str:
    """What keeps `view` from the targets a scale asked for ("" when there); RuntimeError
    when other targets replaced them (another scale, the planner): they never land."""
    from tandem.cluster.admin_client import shortfall

    targets = view.get("targets") or {}
    if (targets.get("prefill"), targets.get("decode")) != (prefill, decode):
        raise RuntimeError(
            f"the targets changed to prefill {targets.get('prefill')}, decode "
            f"{targets.get('decode')} (another scale or the planner) before these were reached"
        )
    return shortfall(view)


def _run_drain(args: argparse.Namespace) -> int:
    from tandem.cluster.admin_client import still_running

    if args.worker is None and not args.ray_address:
        print("tandem drain: --node and --this-node need --ray-address (they drain a Ray "
              "node through the pool controller)", file=sys.stderr)  # fmt: skip
        return EXIT_REFUSED
    node = args.node
    # The workers the drain moves off, from its first answer.
    drained: list[str] = []

    def change(client) -> PoolsView:
        nonlocal node
        if args.worker is not None:
            view = client.drain(args.worker)
        else:
            node = client.resolve_node(node) if node else client.this_node()
            view = client.drain_node(node, args.timeout)
        drained.extend(w["id"] for w in still_running(view, args.worker, node))
        return view

    def pending(view: PoolsView) -> str:
        running = still_running(view, args.worker, node)
        return ", ".join(f"{w['id']} ({w['state']}, {w['running']} running)" for w in running)

    code, _ = _change_then_wait("drain", args, change, pending)
    if code == 0:
        what = f"worker {args.worker}" if args.worker is not None else f"node {node}"
        print(f"{what}: drained and stopped: {', '.join(drained) or 'no workers'}")
    return code


def _change_then_wait(
    name: str,
    args: argparse.Namespace,
    change: Callable[[Any], PoolsView],
    pending: Callable[[PoolsView], str],
) -> tuple[int, PoolsView]:
    """Make `change` through the admin client, then poll the pools until `pending` says
    nothing is left ("") or `args.timeout` passes; (exit code, last view)."""
    from tandem.cluster.admin_client import AdminRefused, AdminUnreachable

    deadline = time.monotonic() + args.timeout
    view: PoolsView = {}
    try:
        client = _client(args)
        view = change(client)
        while gap := pending(view):
            if time.monotonic() > deadline:
                print(f"tandem {name}: timed out after {args.timeout:g} s: {gap}", file=sys.stderr)
                return EXIT_TIMEOUT, view
            time.sleep(max(0.0, min(0.5, deadline - time.monotonic())))
            view = client.get_pools()
    except AdminRefused as exc:
        print(f"tandem {name}: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED, view
    except (AdminUnreachable, RuntimeError) as exc:
        print(f"tandem {name}: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT, view
    return 0, view


def _run_router(args: argparse.Namespace) -> int:
    import asyncio

    ray_auth_env()
    from tandem.cluster.router_process import run_router
    from tandem.cluster.security_flags import server_api_key
    from tandem.router.ports import PortInUse

    try:
        api_key = server_api_key(args.api_key)
        if args.grpc_port is not None and args.grpc_port == args.http_port != 0:
            raise ValueError(f"--grpc-port and --http-port must differ, both {args.http_port}")
    except ValueError as exc:
        print(f"tandem router: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    overrides = {
        name: value
        for name, value in (
            ("host", args.host),
            ("grpc_port", args.grpc_port),
            ("http_port", args.http_port),
            ("api_key", api_key),
        )
        if value is not None
    }
    try:
        asyncio.run(run_router(args.ray_address, overrides))
    except (RuntimeError, PortInUse) as exc:
        print(f"tandem router: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except ConnectionError as exc:  # no Ray cluster at --ray-address
        print(f"tandem router: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    return 0

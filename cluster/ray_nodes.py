"""Ray nodes as the pool controller sees them: which may be drained, and keeping new
actors off one.

`keep_new_actors_off` asks Ray's GCS to drain a node for preemption, with the time
after which its owner will stop it: Ray places no new actor there while the actors
already there keep running and answering, and once nothing holds the node's resources
its raylet stops by itself (with every process on the node). It is how a node that is
about to go (a Kubernetes pod stopping, a VM reclaimed) hands its workers over without
a replacement landing on it. So neither the head node (the GCS) nor the controller's
own node may be drained. Ray's public API has no call for it: `ray drain-node` (a
hidden CLI, "not covered by Ray's API stability guarantees") calls the same
`GcsClient.drain_node`, so this module is the one place that touches it, and any
failure there refuses the drain whole.
"""

from __future__ import annotations

import time

import ray

DRAIN_MESSAGE = "Tandem: this node's workers are moving off it"


# A resource only Ray's head node has.
HEAD_NODE_RESOURCE = "node:__internal_head__"


def resolve_node_id(prefix: str) -> str:
    """The alive Ray node whose id starts with `prefix` (`tandem pools` shows 12
    characters); ValueError when none or several do."""
    found = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"].startswith(prefix)]
    if len(found) != 1:
        what = "no alive Ray node" if not found else f"{len(found)} alive Ray nodes"
        raise ValueError(f"node: {what} with an id starting {prefix[:64]!r}")
    return found[0]


def check_drainable(node_id: str) -> None:
    """ValueError unless `node_id` is an alive Ray node other than the head and the
    caller's own."""
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n.get("Alive")), None)
    if node is None:
        raise ValueError(f"node: no alive Ray node {node_id!r}")
    if HEAD_NODE_RESOURCE in node.get("Resources", {}):
        raise ValueError(f"node: {node_id} is the Ray head node; drain its workers one by "
                         "one (--worker)")  # fmt: skip
    if node_id == ray.get_runtime_context().get_node_id():
        raise ValueError(f"node: the pool controller runs on {node_id}; drain its workers "
                         "one by one (--worker)")  # fmt: skip


def keep_new_actors_off(node_id: str, deadline_s: float) -> None:
    """Mark `node_id` draining in Ray (it goes within `deadline_s`); RuntimeError when
    Ray refuses or the call is not there."""
    try:
        from ray.core.generated import autoscaler_pb2

        gcs = ray._raylet.GcsClient(  # type: ignore[attr-defined]
            address=ray.get_runtime_context().gcs_address
        )
        deadline_ms = int((time.time() + deadline_s) * 1000)
        reason = autoscaler_pb2.DrainNodeReason.Value(  # type: ignore[attr-defined]
            "DRAIN_NODE_REASON_PREEMPTION"
        )
        accepted, why = gcs.drain_node(node_id, reason, DRAIN_MESSAGE, deadline_ms)
    except Exception as exc:  # a private API: any change in it refuses the drain
        raise RuntimeError(f"node: Ray could not mark {node_id} draining: {exc!r}") from None
    if not accepted:
        raise RuntimeError(f"node: Ray refused to drain {node_id}: {why}")

"""Moved to `tests.helpers.inproc_cluster`. Only tests/bench (owned by another branch)
still imports this path; delete this file once it imports the helper directly."""

from tests.helpers.inproc_cluster import InprocCluster

__all__ = ["InprocCluster"]

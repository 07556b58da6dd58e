"""How `make test` spreads the suite over two pytest processes (pytest-xdist, `-n 2`): a
test runs in whichever process is free, except the tests of modules marked
`DISRUPTS_ITS_CLUSTER`, which all go to one process and run one after another.

The grouping is this module's scheduler (`DisruptionScheduling`, installed by
tests/conftest.py through xdist's `pytest_xdist_make_scheduler` hook), not xdist's
`--dist loadgroup`: that one tags a grouped test by rewriting its node id, which pytest
9.2 ignores, so it spreads marked tests as if unmarked (pytest-xdist issue #1386)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

# For modules whose tests kill, signal, scale, drain or restart the processes of a
# cluster (Ray, `tandem serve`, worker processes), or time how it reacts: no two such
# tests overlap, so one's kills and restarts never eat into another's health-check and
# restart deadlines. A cluster that only serves is load like any in-process test.
DISRUPTS_ITS_CLUSTER = pytest.mark.disrupts_cluster
_MARK_NAME = "DISRUPTS_ITS_CLUSTER"
# The scope (xdist's unit of work sent to one process) of every marked module's tests.
DISRUPTION_SCOPE = "disrupted_clusters"


def module_marks(source: str) -> set[str]:
    """The names in a module's `pytestmark = ...` assignment."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "pytestmark":
            return {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    return set()


def disrupting_modules(root: Path) -> frozenset[str]:
    """The marked test modules, as node ids spell them (relative to `root`); only files
    that name the mark are parsed."""
    return frozenset(
        path.relative_to(root).as_posix()
        for path in (root / "tests").rglob("test_*.py")
        if _MARK_NAME in (text := path.read_text()) and _MARK_NAME in module_marks(text)
    )


class DisruptionScheduling(LoadScopeScheduling):
    """xdist's load-by-scope scheduling with one scope for all marked modules' tests
    and one per test otherwise (scopes go out largest first, so the marked modules
    start at once in one process while the other takes single tests)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        self.disrupting_modules = disrupting_modules(config.rootpath)

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return DISRUPTION_SCOPE if module in self.disrupting_modules else nodeid

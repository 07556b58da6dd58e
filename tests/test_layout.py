"""The package layout keeps its promises: a pure engine, one-way imports between folders."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers.parallel import disrupting_modules

ROOT = Path(__file__).resolve().parents[1]


def setup_top_level() -> list[str]:
    """setup.py's TOP_LEVEL: the folders installed under `tandem` (the one list of them)."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TOP_LEVEL":
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py defines no TOP_LEVEL")


PACKAGES = setup_top_level()
# The engine is the model runtime both workers share: no servers, wire formats or metrics.
ENGINE_FORBIDDEN = {
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "prometheus_client",
    "opentelemetry",
    "aiohttp",
    "ray",
    *(f"tandem.{name}" for name in PACKAGES if name != "engine"),
}


def imported_modules(path: Path) -> set[str]:
    """Absolute module names a file imports (top of file or inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def package_imports(package: str) -> set[str]:
    """The other top-level Tandem packages that `package` imports."""
    found: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "tandem" and len(parts) > 1 and parts[1] != package:
                found.add(parts[1])
    return found


def test_engine_imports_no_service_code():
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in (ROOT / "engine").rglob("*.py")
        for module in imported_modules(path)
        if any(module == bad or module.startswith(f"{bad}.") for bad in ENGINE_FORBIDDEN)
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_between_packages(package: str):
    graph = {name: package_imports(name) for name in PACKAGES}
    # Depth-first walk from `package`: reaching it again is a cycle.
    stack = [(dep, [package, dep]) for dep in graph[package]]
    seen: set[str] = set()
    while stack:
        node, trail = stack.pop()
        assert node != package, "import cycle: " + " -> ".join(trail)
        if node in seen or node not in graph:
            continue
        seen.add(node)
        stack.extend((dep, [*trail, dep]) for dep in graph[node])


def test_no_generic_top_level_names_in_code():
    """Code imports `tandem.engine`, never a bare `engine` (which is not installed)."""
    offenders = []
    for package in [*PACKAGES, "tests"]:
        for path in (ROOT / package).rglob("*.py"):
            for module in imported_modules(path):
                if module.split(".")[0] in PACKAGES:
                    offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not offenders, offenders


def _absolute_module(path: Path, node: ast.ImportFrom) -> str:
    """The absolute name of a `from ... import` (relative ones resolved against `path`)."""
    if node.level == 0:
        return node.module or ""
    package = path.relative_to(ROOT).with_suffix("").parts[: -node.level]
    return ".".join([*package, *([node.module] if node.module else [])])


def test_tests_share_code_only_through_helpers():
    """Test modules import shared code from `tests.helpers` (and get fixtures from
    conftest), never from one another: moving or deleting one test cannot break another."""
    offenders = []
    for path in (ROOT / "tests").rglob("*.py"):
        relative = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _absolute_module(path, node)
                # `from tests import x` imports the module tests.x.
                names = [f"{module}.{alias.name}" for alias in node.names]
                modules = names if module == "tests" else [module]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "tests" and parts[1:2] != ["helpers"]:
                    offenders.append(f"{relative} imports {module}")
    assert not offenders, offenders


# What starts a cluster of processes in a test module (Ray, `tandem serve`, workers), and
# what kills or signals its processes.
CLUSTER_STARTERS = re.compile(
    r"\b(LocalCluster|ProcessCluster|TandemCommand|start_local_ray|init_ray_with_role_slots"
    r"|Cluster)\("
)
PROCESS_KILLS = re.compile(r"os\.kill|\.kill(_session)?\b|\bSIG(KILL|TERM|STOP)\b")


def test_modules_that_kill_cluster_processes_run_one_at_a_time():
    """`make test` runs the suite in two pytest processes; a module that starts a cluster
    of processes and kills or signals them carries `DISRUPTS_ITS_CLUSTER`
    (tests/helpers/parallel.py), so that two such tests never overlap."""
    marked = disrupting_modules(ROOT)  # what the scheduler sends to one process
    unmarked = [
        name
        for path in (ROOT / "tests").rglob("test_*.py")
        if CLUSTER_STARTERS.search(text := path.read_text())
        and PROCESS_KILLS.search(text)
        and (name := path.relative_to(ROOT).as_posix()) not in marked
    ]
    assert not unmarked, unmarked


def test_every_code_folder_is_installed_and_type_checked():
    folders = sorted(
        path.parent.name for path in ROOT.glob("*/__init__.py") if path.parent.name != "tests"
    )
    assert sorted(PACKAGES) == folders
    makefile = (ROOT / "Makefile").read_text()
    # The variable's value, over any backslash-continued lines.
    match = re.search(r"^PACKAGES :=((?:.*\\\n)*.*)$", makefile, re.MULTILINE)
    assert match, "Makefile defines no PACKAGES"
    listed = match.group(1).replace("\\", " ").split()
    assert sorted(listed) == folders, "Makefile PACKAGES (mypy) must list setup.py's TOP_LEVEL"

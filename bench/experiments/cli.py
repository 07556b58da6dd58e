"""`tandem-bench experiment NAME`: run an experiment end to end and publish it."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tandem.bench.experiments import frontier, goodput, head_of_line
from tandem.bench.experiments.setup import (
    ExperimentSetup,
    grpc_client,
    http_client,
    interleaved_sweep,
)
from tandem.bench.harness import running
from tandem.bench.loadgen.runner import sweep_to_json
from tandem.bench.report import machine_facts, write_json, write_section

EXPERIMENTS = ("head-of-line", "frontier", "goodput")
HEADINGS = {
    "head-of-line": "## Experiment: head-of-line blocking",
    "frontier": "## Experiment: throughput/latency frontier (Tandem and transformers serve)",
    "goodput": "## Experiment: goodput on a mixed workload (Tandem and transformers serve)",
}

logger = logging.getLogger(__name__)


def main(args: argparse.Namespace) -> int:
    if not (args.model / "config.json").is_file():
        print(f"tandem-bench experiment: no model at {args.model} (tandem model make)")
        return 2
    doc_path = Path(args.doc) if args.doc else None
    setup = ExperimentSetup(str(args.model), args.results_dir, args.img_dir, doc_path, args.quick)
    names = EXPERIMENTS if args.name == "all" else (args.name,)
    asyncio.run(run_experiments(setup, names))
    return 0


async def run_experiments(setup: ExperimentSetup, names: Sequence[str]) -> None:
    facts = machine_facts()
    if "head-of-line" in names:
        await _head_of_line(setup, facts)
    shared = [name for name in ("frontier", "goodput") if name in names]
    if shared:
        await _frontier_and_goodput(setup, shared, facts)


async def _head_of_line(setup: ExperimentSetup, facts: dict[str, Any]) -> None:
    results = {}
    for system in head_of_line.SYSTEMS:
        spec = setup.server(system)
        with running([spec], setup.results_dir / "logs"):
            results[spec.label] = await head_of_line.run_one(setup, grpc_client(spec))
    stats = {label: head_of_line.head_of_line_stats(r.load.traces) for label, r in results.items()}
    runs = {label: r.to_json() for label, r in results.items()}
    _save(setup, "head-of-line", facts, {"stats": stats, "runs": runs})
    image = _image(setup, "head-of-line")
    head_of_line.plot(results, str(image))
    _publish(setup, "head-of-line", facts, head_of_line.render(results, _link(setup, image)))


async def _frontier_and_goodput(
    setup: ExperimentSetup, names: Sequence[str], facts: dict[str, Any]
) -> None:
    """Both use the same servers: started once, every level interleaved across them."""
    specs = [setup.server(system) for system in frontier.SYSTEMS]
    with running(specs, setup.results_dir / "logs"):
        clients = {spec.label: http_client(spec) for spec in specs}
        for name in names:
            module = frontier if name == "frontier" else goodput
            results = await interleaved_sweep(module.plan_for(setup), clients, setup.seed)
            _save(setup, name, facts, {label: sweep_to_json(r) for label, r in results.items()})
            image = _image(setup, name)
            module.plot(results, str(image))
            _publish(setup, name, facts, module.render(results, _link(setup, image)))


def _image(setup: ExperimentSetup, name: str) -> Path:
    """Published plots go to `img_dir`; a quick (smoke) run's stay with its results."""
    folder = setup.results_dir if setup.quick else setup.img_dir
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"experiment-{name}{'-quick' if setup.quick else ''}.png"


def _link(setup: ExperimentSetup, image: Path) -> str:
    """The image's path relative to the doc (docs/img/x.png → img/x.png)."""
    if setup.doc_path is None:
        return str(image)
    try:
        return str(image.resolve().relative_to(setup.doc_path.resolve().parent))
    except ValueError:
        return str(image.resolve())


def _save(setup: ExperimentSetup, name: str, facts: Mapping[str, Any], data: Any) -> None:
    path = setup.results_dir / f"{name}{'-quick' if setup.quick else ''}.json"
    write_json(path, {"machine": facts, "results": data})
    logger.info("results: %s", path)


def _publish(setup: ExperimentSetup, name: str, facts: Mapping[str, Any], body: str) -> None:
    """The section's generated blocks: the run and its machine, then the plot and tables
    (the method between them is hand-written in the doc)."""
    command = f"tandem-bench experiment {name}{' --quick' if setup.quick else ''}"
    head = (
        f"Command: `{command}` (or `all`). Machine: {facts['cores']} cores, {facts['cpu']}; "
        f"1-minute load {facts['load_avg_1m_at_start']:.2f} at the start; run started "
        f"{facts['started']}. Model: `{setup.model_dir}` (fp32)."
    )
    print(f"\n{HEADINGS[name]}\n\n{head}\n\n{body}")
    if setup.doc_path is not None and not setup.quick:
        write_section(setup.doc_path, HEADINGS[name], [head, body])

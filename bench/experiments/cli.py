"""`tandem-bench experiment NAME`: run an experiment end to end and publish it."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.bench.experiments.setup import ExperimentSetup

EXPERIMENTS = ("head-of-line", "frontier", "goodput")
HEADINGS = {
    "head-of-line": "## Experiment: head-of-line blocking",
    "frontier": "## Experiment: throughput/latency frontier (Tandem and transformers serve)",
    "goodput": "## Experiment: goodput on a mixed workload (Tandem and transformers serve)",
}

logger = logging.getLogger(__name__)


def main(args: argparse.Namespace) -> int:
    from tandem.bench.experiments.setup import ExperimentSetup

    if not (args.model / "config.json").is_file():
        print(f"tandem-bench experiment: no model at {args.model} (tandem model make)")
        return 2
    setup = ExperimentSetup(
        model_dir=str(args.model),
        results_dir=args.results_dir,
        img_dir=args.img_dir,
        doc_path=Path(args.doc) if args.doc else None,
        quick=args.quick,
    )
    names = EXPERIMENTS if args.name == "all" else (args.name,)
    asyncio.run(run_experiments(setup, names))
    return 0


async def run_experiments(setup: ExperimentSetup, names: Sequence[str]) -> None:
    from tandem.bench.report import machine_facts

    facts = machine_facts()
    if "head-of-line" in names:
        await _head_of_line(setup, facts)
    shared = [name for name in ("frontier", "goodput") if name in names]
    if shared:
        await _frontier_and_goodput(setup, shared, facts)


async def _head_of_line(setup: ExperimentSetup, facts: dict[str, Any]) -> None:
    from tandem.bench.experiments import head_of_line
    from tandem.bench.experiments.setup import grpc_client
    from tandem.bench.harness import running

    results = {}
    for system in head_of_line.SYSTEMS:
        spec = setup.server(system)
        with running([spec], setup.results_dir / "logs"):
            results[spec.label] = await head_of_line.run_one(setup, grpc_client(spec))
    stats = {
        label: head_of_line.head_of_line_stats(r.load.traces).to_json()
        for label, r in results.items()
    }
    _save(
        setup,
        "head-of-line",
        facts,
        {
            "stats": stats,
            "runs": {label: r.to_json() for label, r in results.items()},
        },
    )
    image = _image(setup, "head-of-line")
    head_of_line.plot(results, str(image))
    _publish(setup, "head-of-line", facts, head_of_line.render(results, setup, _link(setup, image)))


async def _frontier_and_goodput(
    setup: ExperimentSetup, names: Sequence[str], facts: dict[str, Any]
) -> None:
    """Both use the same servers: started once, every level interleaved across them."""
    from tandem.bench.experiments import frontier, goodput
    from tandem.bench.experiments.setup import http_client
    from tandem.bench.harness import running
    from tandem.bench.loadgen.runner import sweep_to_json

    specs = [setup.server(system) for system in frontier.SYSTEMS]
    with running(specs, setup.results_dir / "logs"):
        clients = {spec.label: http_client(spec) for spec in specs}
        for name in names:
            module = frontier if name == "frontier" else goodput
            run = frontier.run_frontier if name == "frontier" else goodput.run_goodput
            results = await run(setup, clients)
            _save(setup, name, facts, {label: sweep_to_json(r) for label, r in results.items()})
            image = _image(setup, name)
            if name == "goodput":
                goodput.plot(results, str(image), goodput.plan_for(setup).slo)
            else:
                frontier.plot(results, str(image))
            _publish(setup, name, facts, module.render(results, setup, _link(setup, image)))


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
    setup.results_dir.mkdir(parents=True, exist_ok=True)
    path = setup.results_dir / f"{name}{'-quick' if setup.quick else ''}.json"
    path.write_text(json.dumps({"machine": facts, "results": data}, indent=1) + "\n")
    logger.info("results: %s", path)


def _publish(setup: ExperimentSetup, name: str, facts: Mapping[str, Any], body: str) -> None:
    from tandem.bench.report import write_section

    command = f"tandem-bench experiment {name}{' --quick' if setup.quick else ''}"
    head = (
        f"Command: `{command}` (or `all`). Machine: {facts['cores']} cores, {facts['cpu']}; "
        f"1-minute load {facts['load_avg_1m_at_start']:.2f} at the start; run started "
        f"{facts['started']}. Model: `{setup.model_dir}` (fp32)."
    )
    print(f"\n{HEADINGS[name]}\n\n{head}\n\n{body}")
    if setup.doc_path is None or setup.quick:
        return
    write_section(setup.doc_path, HEADINGS[name], f"{head}\n\n{body}")

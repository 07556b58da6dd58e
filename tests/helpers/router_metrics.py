"""Counters read straight from an in-process router's metrics (no scrape)."""

from __future__ import annotations

from tandem.router.server import Router


def migration_counts(router: Router) -> dict[str, float]:
    """The router's `tandem:request_migrations_total` by reason."""
    counts = {}
    for metric in router.metrics.migrations.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counts[sample.labels["reason"]] = sample.value
    return counts

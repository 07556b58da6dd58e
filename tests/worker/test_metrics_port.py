"""The worker's fixed metrics port from the environment (what the Helm chart sets)."""

from __future__ import annotations

import pytest

from tandem.worker.metrics import METRICS_PORT_ENV, metrics_port_from_env


def test_unset_or_empty_means_a_free_port():
    assert metrics_port_from_env({}) == 0
    assert metrics_port_from_env({METRICS_PORT_ENV: " "}) == 0


def test_a_port_is_taken():
    assert metrics_port_from_env({METRICS_PORT_ENV: "9100"}) == 9100


@pytest.mark.parametrize("bad", ["0", "65536", "-1", "http"])
def test_a_bad_value_names_the_variable(bad: str):
    with pytest.raises(ValueError, match=METRICS_PORT_ENV):
        metrics_port_from_env({METRICS_PORT_ENV: bad})

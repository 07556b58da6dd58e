"""Installs the design's top-level folders under one import namespace, `tandem`.

The folder `engine/` installs as `tandem.engine`, `router/` as `tandem.router`, and so on,
so the repository's top level shows the architecture while an installed Tandem claims
no generic names (`engine`, `proto`, `bench`) in a user's environment. `tandem` itself is
an implicit namespace package: it has no folder of its own.
"""

from setuptools import find_packages, setup

TOP_LEVEL = [
    "engine",
    "worker",
    "telemetry",
    "prefill_worker",
    "decode_worker",
    "kv_transfer",
    "router",
    "proto",
    "cluster",
    "planner",
    "bench",
]

packages = find_packages(include=[f"{name}*" for name in TOP_LEVEL])
setup(
    packages=[f"tandem.{name}" for name in packages],
    package_dir={f"tandem.{name}": name for name in TOP_LEVEL},
)

"""The published experiments (docs/benchmarks.md): `tandem-bench experiment NAME`."""

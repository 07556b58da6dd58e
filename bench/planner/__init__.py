"""Benchmarks of the P:D planner (`tandem-bench planner-fidelity`)."""

"""The published experiments (docs/benchmarks.md): `tandem-bench experiment NAME`.

head_of_line (a long prompt among streaming short ones), frontier (concurrency sweep) and
goodput (rate sweep of a mixed workload); the peer, `transformers serve`, is one of the
systems of the frontier and goodput runs. Each runs real server processes (`bench.harness`)
and drives them with the load generator (`bench.loadgen`).
"""

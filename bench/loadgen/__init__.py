"""The one load generator: it times every token itself (`tandem-bench run|sweep`; the
router and experiment suites drive it from Python).

The pieces, in the order a run uses them (each experiment is a short script over them):

- `workloads`: deterministic request specs (fixed, random, shared-prefix, chat mix, long
  prompts), each a pure function of (workload, seed, index);
- `clients`: one streaming client per target kind (`grpc://` Tandem `Generate`,
  `http://` OpenAI-compatible `/v1/completions` with SSE) → a `RequestTrace` per request;
- `load`: closed-loop (N workers) and open-loop (seeded Poisson) drivers, long-prompt
  injection, a global timeout, a progress bar;
- `metrics`: pure functions over traces (TTFT, ITL, TPOT, e2e, percentiles, throughput,
  SLO attainment, goodput) → a `RunSummary`;
- `tables` (over `bench.report.render_table`) and `plots` (matplotlib); `runner`: one
  run or a sweep from a `BenchConfig`; `cli`: `tandem-bench run|sweep`.

Nothing heavy is imported here, so `tandem-bench --help` stays fast.
"""

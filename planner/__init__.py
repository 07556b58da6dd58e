"""The P:D planner: profile the hardware, simulate the cluster, recommend the split.

- `profile`: `tandem profile` measures one worker's prefill and decode step times and
  the KV transfer throughput between two workers, with the real engine, into a JSON file.
- `profile_model`: reads that file and fits it into the latency laws the simulator uses.
- `traces`, `workload`: the requests to simulate (a trace file, or synthetic lengths).
- `sim_worker`, `simulator`: a discrete-event simulation of the cluster as built (the
  router's own goodput policy places every request).
- `search`: the highest rate each split sustains within the SLOs, and the recommendation.
- `plan_cli`: `tandem plan`; `live`: the planner inside a serving router's process.

Imports go one way: the planner uses the router's policy, the router never imports it.
"""

"""splitserve's benchmark: load generator, metrics, A/B comparison and report.

Modules, one job each:
- `workload`: request streams (`WorkloadSpec` → `build_stream` → `Request`s), fixed by a seed;
  the `INTERFERENCE` mix. Reused by the simulator.
- `repeat`: the spec parts of the workloads that repeat prefixes, and their ideal reuse;
  `mooncake`: Mooncake-format traces (replay, sampling, scaling, a generator); `multiturn`:
  closed-loop chat sessions that resend the server's answers.
- `client`: the asyncio streaming client (`run_stream`) and per-request `RequestRecord`s.
- `metrics`: TTFT, TPOT, pooled ITL, E2EL, throughput, errors, SLO attainment, goodputs;
  `cachestats`: prompt tokens cached against computed, as the servers report them.
- `runner`: one run / repeats / a rate sweep → a result dict (schema `splitserve.bench/1`).
- `runsheet`: versions, commit, model hash, deployment, hardware, workload.
- `report`: progress bar, summary table, result JSON, PNG plots, HTML report.
- `deploy`: deployments the benchmark starts itself (colocated, 1P+1D).
- `demo`: `run_demo()`, the interference demo on the embedded model.
- `cli`: `splitserve bench`, `bench compare`, `bench report`, `bench make-trace`.
"""

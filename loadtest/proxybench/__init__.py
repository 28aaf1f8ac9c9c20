"""The proxy benchmark: is the gateway the bottleneck, and what does it cost per request? (Not `crossover bench`,
which measures model servers.)

    python -m crossover.loadtest.proxybench --markdown bench-out/proxybench.md

- `harness`: starts the zero backend, crossover and the peers, runs every cell against each, judges the bar
- `peers`: the Rust gateways measured against (smg, vllm-router): pinned, each in its own venv, their flags
- `loadgen`: the closed-loop load generator each cell runs in its own process; measures the target's CPU
- `cpu`: a process tree's CPU time, from /proc
- `cores`: the core sets each role is pinned to (a host with cores to spare)
- `redisserver`: the redis-server of the crossover-redis target (what the cluster's coordination costs)
- `report`: the bar (CPU per request, added latency) checked line by line, and the table as text or markdown
- `soak`: each worker's RSS under mixed traffic over time (`python -m crossover.loadtest.proxybench.soak`)
- `zerobackend`: the zero-work OpenAI-compatible backend the proxies are measured against
"""

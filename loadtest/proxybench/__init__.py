"""The proxy benchmark: is the gateway the bottleneck? (Not `crossover bench`, which measures model servers.)

    python -m crossover.loadtest.proxybench --markdown bench-out/proxybench.md

- `harness`: starts the zero backend, crossover and sglang-router, runs every cell against each, judges the bar
- `loadgen`: the closed-loop load generator each cell runs in its own process
- `report`: the bar (issue 3) checked line by line, and the table as text or markdown
- `zerobackend`: the zero-work OpenAI-compatible backend the proxies are measured against
"""

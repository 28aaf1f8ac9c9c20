"""What "off" costs on vLLM's gate, on CPU: `crossover bench --in-engine` against a real gated vLLM 0.32.0, beside a
plain vLLM, each pinned to a core of its own (the README's "In-engine" table; a benchmark, not a test).

    python -m tests.real_vllm.gate_cost OUT_DIR [--accept 2.75] [--concurrency 1,2,4,7] [-- BENCH_FLAGS...]

Both servers are the ones tests/real_vllm starts (conftest.py): the tiny target, the gated one as `gated_vllm`
starts it (patches/vllm-0.32.0 on an overlay of `.venv-vllm`'s vLLM, `GATED_PROFILE` launched by servers/) at the
given synthetic acceptance, the plain one as `real_vllm` starts it. Stopped at the end, whatever ends the run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from crossover.gateway.modes import PLAIN
from crossover.servers.process import stop
from tests.host_cores import claimed_cores
from tests.host_speed import StartupBudget
from tests.real_vllm import conftest as rv

BENCH = ("--output-len", "64", "--input-len", "4", "--duration-per-level", "40", "--warmup-rounds", "1", "--no-plots")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.real_vllm.gate_cost", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--accept", type=float, default=rv.ACCEPTANCE_LENGTH, help="the gated server's acceptance")
    parser.add_argument("--concurrency", default="1,2,4,7", help=f"below the gated cap ({rv.GATE_CAP})")
    argv = sys.argv[1:] if argv is None else argv
    at = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:at])  # after --: more `crossover bench` flags
    more = argv[at + 1 :]
    venv = rv.vllm_venv()
    args.out.mkdir(parents=True, exist_ok=True)
    model = rv.make_model(venv, args.out / "model")
    servers: list[rv.VLLMServer] = []
    with claimed_cores(2) as (plain_core, gated_core):
        try:
            servers.append(rv.start_server(venv, model, PLAIN, plain_core, args.out))
            gated, key = rv.start_gated(venv, model, args.accept, gated_core, args.out)
            servers.append(gated)
            budget, began = StartupBudget.measure(rv.IDLE_START_S, "the gate-cost servers"), time.monotonic()
            for server in servers:
                rv.ready(server, budget, since=began)
            bench = [sys.executable, "-m", "crossover.gateway.cli", "bench", "--in-engine", gated.url]
            bench += ["--admin-key-file", str(key), "--target", f"plain={servers[0].url}", "--model", rv.MODEL_NAME]
            bench += ["--concurrency", args.concurrency, "--out", str(args.out / "bench"), *BENCH, *more]
            return subprocess.run(bench, check=False).returncode
        finally:
            stop([server.proc for server in servers])


if __name__ == "__main__":
    sys.exit(main())

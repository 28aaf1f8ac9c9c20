"""Run tests beside CPU-burning processes: a test that passes only on an idle machine fails here.

    python -m tests.busy                      # the suite's timing-sensitive tests (TIMING_SENSITIVE) beside 2 burners
    python -m tests.busy --burners 3 tests/servers/sim/test_live.py -x -q

The burners are `python -c 'while True: pass'`, started here and stopped here by pid, whatever pytest does.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

# Tests that judge time, throughput or a switch against load, or wait (bounded) on live stand-ins.
TIMING_SENSITIVE = [
    "tests/servers/sim/test_live.py",
    "tests/servers/sim/test_schedule.py",
    "tests/servers/test_demo.py",
    "tests/loadtest/test_bench_uncertainty.py",
    "tests/loadtest/test_standin.py",
    "tests/loadtest/test_runner.py",
    "tests/gateway/test_health.py",
    "tests/gateway/test_admission.py",
    # The switch controller's: policy decisions on a clock the test owns, live switches and recoveries on bounded
    # waits (tests/gateway/ticking.py).
    "tests/gateway/test_switching.py",
    "tests/gateway/test_switching_restart.py",
    "tests/gateway/test_switching_recovery.py",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.busy", description=__doc__.splitlines()[0])
    parser.add_argument("--burners", type=int, default=2, help="CPU-burning processes beside the tests (default: 2)")
    args, pytest_args = parser.parse_known_args(argv)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    try:
        command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", *(pytest_args or TIMING_SENSITIVE)]
        print(f"{args.burners} burners (pids {', '.join(str(b.pid) for b in burners)}): {' '.join(command)}")
        return subprocess.run(command, check=False).returncode
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


if __name__ == "__main__":
    sys.exit(main())

"""Run tests beside CPU-burning processes: a test that passes only on an idle machine fails here.

    python -m tests.busy                      # every test marked `timing` (tests/timing.py finds them) beside 2 burners
    python -m tests.busy --burners 3 tests/servers/sim/test_live.py -x -q   # arguments replace the selection

The burners are `python -c 'while True: pass'`, started here and stopped here by pid, whatever pytest does.
By default it runs what tests/timing.py finds - every test that starts a live stand-in or reads a wall clock -
but not tests/real_sglang/ or tests/real_vllm/: the real engines take minutes to start, their waits are bounded
in minutes (UP_TIMEOUT_S, READY_TIMEOUT_S), and each folder's tests share engines started once, so they show
nothing here that the main run's shared machine does not.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

# Two workers, as `pytest -n auto` runs on CI's two cores: most of these tests wait on something paced in wall
# time, so two at once halve the run without easing the load (the burners still want both cores).
DEFAULT = [
    "-n",
    "2",
    "-m",
    "timing and not slow",
    "--ignore",
    "tests/real_sglang",
    "--ignore",
    "tests/real_vllm",
    "tests",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.busy", description=__doc__.splitlines()[0])
    parser.add_argument("--burners", type=int, default=2, help="CPU-burning processes beside the tests (default: 2)")
    args, pytest_args = parser.parse_known_args(argv)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    try:
        command = [sys.executable, "-m", "pytest", "-q", *(pytest_args or DEFAULT)]
        print(f"{args.burners} burners (pids {', '.join(str(b.pid) for b in burners)}): {' '.join(command)}")
        return subprocess.run(command, check=False).returncode
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


if __name__ == "__main__":
    sys.exit(main())

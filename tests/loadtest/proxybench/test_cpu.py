"""A process tree's CPU time from /proc matches what its processes say they burned - threads, a live child and a
reaped one included. CPU time against CPU time: a busy machine slows the burn, it does not change the sums."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from crossover.loadtest.proxybench.cpu import tree_cpu_seconds

BOUND_S = 120.0
# /proc counts in clock ticks (10 ms), four fields per process, three processes: rounding, plus what the
# processes spend between reporting their own time and being sampled (a print, a read on stdin).
TOLERANCE_S = 0.08

BURN = """
import time
def burn(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
"""

CHILD = f"""{BURN}
import sys
burn(float(sys.argv[1]))
print(time.process_time(), flush=True)
sys.stdin.readline()  # stays alive (unreaped) until told, or exits at once when stdin is closed
"""

ROOT = f"""{BURN}
import json, subprocess, sys, threading
CHILD = {CHILD!r}
def child(seconds, stdin):
    return subprocess.Popen([sys.executable, "-c", CHILD, seconds], stdin=stdin, stdout=subprocess.PIPE, text=True)
live, reaped = child("0.3", subprocess.PIPE), child("0.2", subprocess.DEVNULL)
thread = threading.Thread(target=burn, args=(0.2,))
thread.start()
burn(0.1)
thread.join()
children = [float(live.stdout.readline()), float(reaped.stdout.readline())]
reaped.wait()  # its time moves into this process's cutime/cstime
print(json.dumps({{"own": time.process_time(), "children": children}}), flush=True)
sys.stdin.readline()
live.stdin.close()
live.wait()
"""


def test_tree_cpu_counts_threads_live_and_reaped_children():
    root = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(ROOT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        # The root prints once every process in the tree has burned its share and reported it.
        reported = json.loads(root.stdout.readline())
        measured = tree_cpu_seconds(root.pid)
    finally:
        root.communicate("\n", timeout=BOUND_S)
    expected = reported["own"] + sum(reported["children"])
    # The burns alone are 0.8 s: leaving out the thread, the live child or the reaped one is off by >= 0.2 s.
    assert expected >= 0.8
    assert abs(measured - expected) <= TOLERANCE_S, (measured, reported)


def test_a_process_that_is_gone_counts_nothing():
    assert tree_cpu_seconds(2**22 + 1) == 0.0  # above Linux's pid_max: never a live process

"""The synthetic-acceptance fix as installed in the vLLM venv: vLLM's own CPU kernel module, imported in that venv,
runs the Triton kernels' synthetic semantics (a set rate per position, a padded draft never accepted, the bonus
token after a run accepted whole) and still the C++ kernels when synthetic mode is off."""

from __future__ import annotations

import subprocess

from crossover.servers.sglang_check import venv_python
from tests.real_vllm.conftest import ROOT, vllm_venv

CHECK = """
import torch
import vllm.utils.cpu_triton_utils as kernels
from vllm.platforms.cpu import CpuPlatform

CpuPlatform.import_kernels()  # the C++ kernels, as the engine loads them

assert kernels.CROSSOVER_SYNTHETIC_ACCEPTANCE
# Two requests of three drafts each; rates 1, 0.75, 0 (vLLM's schedule for a mean length of 2.75).
rates = torch.tensor([1.0, 0.75, 0.0])
drafts = torch.tensor([11, 12, 13, 21, -1, 23], dtype=torch.int32)
ends = torch.tensor([3, 6], dtype=torch.int32)
bonus = torch.tensor([[19], [29]])
argmax = torch.tensor([101, 102, 103, 201, 202, 203])
uniform = torch.tensor([0.5, 0.5, 0.5, 0.1, 0.1, 0.1], dtype=torch.float64)

out = torch.full((2, 4), -1, dtype=torch.int32)
kernels._rejection_greedy_sample_kernel_impl(out, ends, drafts, argmax, bonus, None, 3, uniform, rates, True)
# Request 0: 11, 12 accepted, position 2 (rate 0) rejected -> the target's 103. Request 1: its padded draft
# (-1) at position 1 is rejected whatever the rate -> 202.
assert out.tolist() == [[11, 12, 103, -1], [21, 202, -1, -1]], out.tolist()

out = torch.full((2, 4), -1, dtype=torch.int32)
kernels._rejection_greedy_sample_kernel_impl(out, ends, drafts, argmax, bonus, None, 3, uniform, torch.ones(3), True)
assert out.tolist() == [[11, 12, 13, 19], [21, 202, -1, -1]], out.tolist()  # all accepted: the bonus token

# Random sampling: only the non-greedy request is the random kernel's; a rejection takes the recovered token.
out = torch.full((2, 4), -1, dtype=torch.int32)
recovered = torch.tensor([301, 302, 303, 401, 402, 403], dtype=torch.int32)
probs = torch.full((6, 8), 0.125)
greedy = torch.tensor([False, True])
kernels._rejection_random_sample_kernel_impl(
    out, ends, drafts, None, probs, bonus, recovered, uniform, greedy, 3, 8, rates, True, True
)
assert out.tolist() == [[11, 12, 303, -1], [-1, -1, -1, -1]], out.tolist()

# Synthetic mode off: the C++ kernel, greedy acceptance by the target's argmax.
out = torch.full((2, 4), -1, dtype=torch.int32)
argmax = torch.tensor([11, 12, 99, 21, 22, 23])
kernels._rejection_greedy_sample_kernel_impl(out, ends, drafts, argmax, bonus, None, 3)
assert out.tolist() == [[11, 12, 99, -1], [21, 22, -1, -1]], out.tolist()
print("ok")
"""


def test_the_cpu_rejection_kernels_accept_synthetically_and_otherwise_run_vllms_own():
    venv = vllm_venv()
    done = subprocess.run(
        [str(venv_python(venv)), "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")

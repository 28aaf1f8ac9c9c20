"""The TP consensus of POST /speculative/adaptive over a real gloo group: two scheduler ranks in two processes,
each with SGLang's dispatcher and internal-state handler, handle the same update; the ranks all-gather their
results with torch.distributed.all_gather_object, and a failure injected on one rank rolls both back.

CPU only (gloo); the scheduler and worker are the fakes of test_adaptive_spec_runtime_endpoint.
"""

import multiprocessing
import os
import tempfile
import types
import unittest
from unittest import mock

WORLD = 2
TIMEOUT_S = 600


def _rank(rank: int, init_file: str, fail_on: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.scheduler_components import internal_state
    from test_adaptive_spec_runtime_endpoint import FakeEagleWorker, fake_scheduler, wire

    group = types.SimpleNamespace(cpu_group=dist.group.WORLD)
    parallel = types.SimpleNamespace(pp_size=1, tp_size=WORLD, tp_group=group)
    with mock.patch.object(internal_state, "get_parallel", lambda: parallel):
        worker = FakeEagleWorker()
        scheduler = fake_scheduler(worker)
        controller = worker.adaptive_controller
        before = controller.policy_digest()
        if rank == fail_on:

            def fail(*_args, **_kwargs):
                raise RuntimeError(f"injected on rank {rank}")

            controller.params.set_zero_steps_above_bs = fail
        update = io_struct.UpdateSpecAdaptiveConfigReqInput(
            set_zero_steps_above_bs=True, zero_steps_above_bs=8, gate_min_dwell_steps=4
        )
        reply = wire(scheduler._request_dispatcher(wire(update)))
        out.put((rank, reply.success, reply.reason, controller.generation, controller.policy_digest() == before))
    dist.destroy_process_group()


def run_ranks(fail_on: int) -> list:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [context.Process(target=_rank, args=(rank, init_file, fail_on, out)) for rank in range(WORLD)]
        for proc in procs:
            proc.start()
        results = sorted(out.get(timeout=TIMEOUT_S) for _ in procs)
        for proc in procs:
            proc.join(TIMEOUT_S)
    return results


class TestConsensusOverGloo(unittest.TestCase):
    def test_ranks_that_agree_apply_and_a_rank_local_failure_rolls_both_back(self):
        # rank, success, reason, generation, policy as before
        self.assertEqual(run_ranks(fail_on=-1), [(0, True, "", 1, False), (1, True, "", 1, False)])
        self.assertEqual(run_ranks(fail_on=1), [(0, False, "failed", 0, True), (1, False, "failed", 0, True)])


if __name__ == "__main__":
    unittest.main()

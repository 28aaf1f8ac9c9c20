"""The TP consensus of POST /speculative/adaptive over a real gloo group: two scheduler ranks in two processes,
each with SGLang's dispatcher and internal-state handler, handle the same update; the ranks all-gather their
results with torch.distributed.all_gather_object. A raise injected on one rank before the update (the snapshot),
inside it (the gate's setter) or after it (the digest, between the update and the vote) still reaches the
collective: no hang (a hang would fail on gloo's timeout and the test's own), both ranks roll back and agree.

CPU only (gloo); the scheduler and worker are the fakes of test_adaptive_spec_runtime_endpoint.
"""

import datetime
import multiprocessing
import os
import tempfile
import types
import unittest
from unittest import mock

WORLD = 2
# Starting two processes that import SGLang takes most of it; the collectives themselves take milliseconds.
TIMEOUT_S = 300
GLOO_TIMEOUT_S = 60
# (where to raise on rank 1, or None) -> every rank's (success, reason, generation, fence, policy as before).
SCENARIOS = (None, "snapshot", "set_zero_steps_above_bs", "policy_digest")


def _rank(rank: int, init_file: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
    )
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.scheduler_components import internal_state
    from test_adaptive_spec_runtime_endpoint import FakeEagleWorker, fake_scheduler, wire

    group = types.SimpleNamespace(cpu_group=dist.group.WORLD)
    parallel = types.SimpleNamespace(pp_size=1, tp_size=WORLD, tp_group=group)
    with mock.patch.object(internal_state, "get_parallel", lambda: parallel):
        for where in SCENARIOS:
            worker = FakeEagleWorker()
            scheduler = fake_scheduler(worker)
            controller = worker.adaptive_controller
            before = controller.policy_digest()
            update = io_struct.UpdateSpecAdaptiveConfigReqInput(
                set_zero_steps_above_bs=True, zero_steps_above_bs=8, gate_min_dwell_steps=4, fence=7
            )
            if rank == 1 and where is not None:
                target = controller.params if where == "set_zero_steps_above_bs" else controller

                def fail(*_args, _where=where, **_kwargs):
                    raise RuntimeError(f"injected in {_where} on rank {rank}")

                with mock.patch.object(target, where, fail):
                    reply = wire(scheduler._request_dispatcher(wire(update)))
            else:
                reply = wire(scheduler._request_dispatcher(wire(update)))
            out.put(
                (
                    where or "",
                    rank,
                    reply.success,
                    reply.reason,
                    controller.generation,
                    controller.fence_highest,
                    controller.policy_digest() == before,
                )
            )
    dist.destroy_process_group()


def run_ranks() -> list:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [context.Process(target=_rank, args=(rank, init_file, out)) for rank in range(WORLD)]
        for proc in procs:
            proc.start()
        try:
            results = sorted(out.get(timeout=TIMEOUT_S) for _ in range(WORLD * len(SCENARIOS)))
            for proc in procs:
                proc.join(TIMEOUT_S)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
    return results


class TestConsensusOverGloo(unittest.TestCase):
    def test_a_raise_on_one_rank_before_inside_or_after_the_update_rolls_both_back_without_a_hang(self):
        results = run_ranks()
        # where, rank, success, reason, generation, fence, policy as before
        expected = [("", rank, True, "", 1, 7, False) for rank in range(WORLD)]
        for where in SCENARIOS[1:]:
            expected += [(where, rank, False, "failed", 0, None, True) for rank in range(WORLD)]
        self.assertEqual(results, sorted(expected))


if __name__ == "__main__":
    unittest.main()

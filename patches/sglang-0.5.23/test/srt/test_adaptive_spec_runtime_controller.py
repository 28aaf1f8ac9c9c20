"""AdaptiveController.update_runtime_config with a fake worker (no GPU).

The fake worker mirrors what EAGLEWorkerV2 does around the controller:
register the startup state, init_states() builds one state per other
candidate step, apply_runtime_state() swaps the active one.
"""

import unittest
from unittest import mock

from sglang.srt.speculative.adaptive_runtime_state import (
    AdaptiveController,
    AdaptiveUpdateConflict,
    SpecRuntimeState,
)
from test_adaptive_spec_runtime_policy import make_params

GRAPH_BS = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48]


def _state(steps):
    return SpecRuntimeState(
        speculative_num_steps=steps,
        speculative_num_draft_tokens=steps + 1,
        draft_attn_backend=None,
        cuda_graph_runner=None,
        target_attn_backend=object(),
        target_graph_runner=None,
        draft_extend_attn_backend=None,
        cuda_graph_runner_for_draft_extend=None,
    )


class FakeWorker:
    def __init__(self, steps):
        self.speculative_num_steps = steps
        self.speculative_num_draft_tokens = steps + 1
        self.built = []  # (steps, graph bs) per build_adaptive_runtime_state
        self.switches = []

    def build_adaptive_runtime_state(self, speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
        self.built.append((speculative_num_steps, cuda_graph_bs))
        return _state(speculative_num_steps)

    def apply_runtime_state(self, state):
        if state.speculative_num_steps == self.speculative_num_steps:
            return
        self.switches.append(state.speculative_num_steps)
        self.speculative_num_steps = state.speculative_num_steps
        self.speculative_num_draft_tokens = state.speculative_num_draft_tokens


def started_controller(cfg=None, graph_bs=GRAPH_BS, padding=True):
    initial_steps = 3  # make_params' startup step
    worker = FakeWorker(initial_steps)
    controller = AdaptiveController(worker, make_params(cfg))
    controller.register(_state(initial_steps))  # EAGLEWorkerV2.init_cuda_graphs
    controller.init_states(cuda_graph_bs=graph_bs, graph_padding=padding)
    return worker, controller


class TestControllerUpdate(unittest.TestCase):
    def test_startup_facts_are_recorded(self):
        worker, c = started_controller()
        self.assertEqual(c.captured_steps, [0, 1, 3, 5, 7])
        self.assertEqual(sorted(s for s, _ in worker.built), [0, 1, 5, 7])
        state = c.runtime_config()
        self.assertEqual(state["captured_graph_bs"]["3"], GRAPH_BS)
        self.assertEqual(state["captured_graph_bs"]["7"], [1, 2, 4])
        self.assertEqual((state["generation"], state["zero_steps_above_bs"]), (0, None))

    def test_gate_applies_at_the_next_batch_and_builds_nothing(self):
        worker, c = started_controller()
        built = list(worker.built)
        c.activate_step_by_batch(20)
        self.assertEqual(worker.speculative_num_steps, 3)

        state = c.update_runtime_config(set_zero_steps_above_bs=True, zero_steps_above_bs=16, gate_min_dwell_steps=0)
        self.assertEqual(state["generation"], 1)
        self.assertEqual((state["gate_min_dwell_steps"], state["gate_engaged"]), (0, False))
        self.assertEqual(worker.speculative_num_steps, 3)  # nothing activated yet
        c.activate_step_by_batch(20)  # next decode batch
        self.assertEqual(worker.speculative_num_steps, 0)
        c.activate_step_by_batch(4)
        self.assertEqual(worker.speculative_num_steps, 3)

        c.update_runtime_config(set_zero_steps_above_bs=True, zero_steps_above_bs=None)
        c.activate_step_by_batch(20)
        self.assertEqual(worker.speculative_num_steps, 3)
        self.assertEqual(worker.built, built)  # no state was (re)built

    def test_gate_without_zero_state_is_rejected(self):
        _worker, c = started_controller(cfg={"1": {"candidate_steps": [1, 3]}})
        with self.assertRaisesRegex(ValueError, "0-step runtime state"):
            c.update_runtime_config(set_zero_steps_above_bs=True, zero_steps_above_bs=8)

    def test_dry_run_and_expected_generation(self):
        _worker, c = started_controller()
        preview = c.update_runtime_config(set_zero_steps_above_bs=True, zero_steps_above_bs=0, dry_run=True)
        self.assertEqual(preview["zero_steps_above_bs"], 0)
        self.assertEqual(c.runtime_config()["zero_steps_above_bs"], None)
        self.assertEqual(c.generation, 0)

        c.update_runtime_config(set_zero_steps_above_bs=True, zero_steps_above_bs=0, expected_generation=0)
        with self.assertRaises(AdaptiveUpdateConflict):
            c.update_runtime_config(set_zero_steps_above_bs=True, zero_steps_above_bs=None, expected_generation=0)
        self.assertEqual(c.runtime_config()["zero_steps_above_bs"], 0)
        c.update_runtime_config(set_zero_steps_above_bs=True, zero_steps_above_bs=None, expected_generation=1)
        self.assertEqual(c.generation, 2)


class TestDecisionFaults(unittest.TestCase):
    """A fault in the adaptive decision (result processing, the forward's activation) keeps the step."""

    def test_an_overflowing_slot_keeps_the_scheduler_running(self):
        worker, c = started_controller()
        # A slot as the release would build it from an unchecked ceiling_coeff: 1e308.
        slot = c.params._slots[1]
        slot.ceiling_coeff, slot.warmup_batches, slot.update_interval = 1e308, 0, 1
        with self.assertLogs("sglang.srt.speculative.adaptive_runtime_state", "ERROR") as logs:
            for _ in range(20):
                c.on_verify_complete([7], batch_size=1)  # raised OverflowError in the release
                c.activate_step_by_batch(1)
        self.assertEqual(worker.speculative_num_steps, 3)
        self.assertGreater(c.decision_errors, 1)
        self.assertEqual(len(logs.records), 1)  # logged once
        self.assertEqual(c.runtime_config()["decision_errors"], c.decision_errors)

    def test_any_exception_and_an_uncaptured_step_keep_the_step(self):
        worker, c = started_controller()

        def broken(*_args, **_kwargs):
            raise RuntimeError("injected")

        with (
            mock.patch.object(c.params, "get_steps_for_batch", broken),
            mock.patch.object(c.params, "on_verify_complete", broken),
        ):
            c.activate_step_by_batch(30)
            c.on_verify_complete([1, 1], batch_size=2)
        with mock.patch.object(c.params, "get_steps_for_batch", lambda _bs: 2):  # no state for 2
            c.activate_step_by_batch(30)
        self.assertEqual(worker.speculative_num_steps, 3)
        self.assertEqual(c.decision_errors, 3)
        c.activate_step_by_batch(100)  # and decisions go on
        self.assertEqual(worker.speculative_num_steps, 0)


def outside_the_graphs(worker, controller, batches):
    """Every (steps, batch size) the worker ran that has no captured CUDA graph: the coverage check's own verdict
    (graph_coverage_gaps over the controller's captured sizes) on each batch after its decision."""
    from sglang.srt.speculative.adaptive_spec_params import graph_coverage_gaps

    params, outside = controller.params, []
    for bs in batches:
        controller.activate_step_by_batch(bs)
        padded = params._pad_to_cuda_graph_bs(bs)
        if padded > max(GRAPH_BS):
            continue  # past every graph: eager at any step
        step = worker.speculative_num_steps
        if graph_coverage_gaps({step: [padded]}, controller._captured_graph_bs, controller._graph_padding):
            outside.append((step, bs))
    return outside


# Without padding (--disable-cuda-graph-padding) the 0-step state has graphs only where a slot lists 0.
SPARSE_ZERO_CFG = {"1": {"candidate_steps": [3]}, "16": {"candidate_steps": [0, 3]}}


class TestTheDwellStaysInsideTheGraphs(unittest.TestCase):
    """The coverage check admits a gate assuming batches above it run 0 steps and batches at or below it their
    slot's; the dwell holds the other state for a while, which must never be a pair without a graph."""

    def test_a_held_engaged_gate_releases_early_rather_than_run_without_a_graph(self):
        worker, controller = started_controller(SPARSE_ZERO_CFG, padding=False)
        self.assertEqual(controller._captured_graph_bs[0], [16, 24, 32, 40, 48])
        controller.update_runtime_config(set_zero_steps_above_bs=True, zero_steps_above_bs=12, gate_min_dwell_steps=32)
        # Engaged at 40; at 2 the dwell would hold 0 steps, which has no graph at 2: released at once.
        self.assertEqual(outside_the_graphs(worker, controller, [40, 2]), [])
        self.assertEqual(worker.speculative_num_steps, 3)
        # Where the held state has a graph the dwell holds it: engaged at 40, still 0 steps at 16.
        controller.update_runtime_config(set_zero_steps_above_bs=True, zero_steps_above_bs=16, gate_min_dwell_steps=32)
        self.assertEqual(outside_the_graphs(worker, controller, [40, 16]), [])
        self.assertEqual(worker.speculative_num_steps, 0)  # held: 16 has a 0-step graph

    def test_no_gate_dwell_or_load_runs_a_batch_outside_the_graphs(self):
        import random

        rng = random.Random(0)
        for padding in (True, False):
            for cfg in (None, SPARSE_ZERO_CFG, {"1": {"candidate_steps": [1, 3]}, "24": {"candidate_steps": [0]}}):
                worker, controller = started_controller(cfg, padding=padding)
                for gate in range(0, 50):
                    for dwell in (1, 4, 32):
                        try:
                            controller.update_runtime_config(
                                set_zero_steps_above_bs=True, zero_steps_above_bs=gate, gate_min_dwell_steps=dwell
                            )
                        except ValueError:
                            continue  # the coverage check refused it: nothing to run
                        batches = [rng.choice(GRAPH_BS) for _ in range(200)]
                        with self.subTest(padding=padding, cfg=cfg, gate=gate, dwell=dwell):
                            self.assertEqual(outside_the_graphs(worker, controller, batches), [])


class TestRollback(unittest.TestCase):
    def test_restore_undoes_gate_dwell_and_generation(self):
        worker, c = started_controller()
        before, digest = c.runtime_config(), c.policy_digest()
        snapshot = c.snapshot()
        c.update_runtime_config(
            set_zero_steps_above_bs=True,
            zero_steps_above_bs=8,
            gate_min_dwell_steps=5,
        )
        self.assertNotEqual(c.policy_digest(), digest)
        c.restore(snapshot)
        self.assertEqual(c.policy_digest(), digest)
        self.assertEqual(c.runtime_config(), before)
        c.activate_step_by_batch(20)
        self.assertEqual(worker.speculative_num_steps, 3)


if __name__ == "__main__":
    unittest.main()

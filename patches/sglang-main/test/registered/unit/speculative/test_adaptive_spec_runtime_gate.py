"""Unit tests for the runtime zero-step gate of adaptive speculative decoding
(srt/speculative/adaptive_runtime_state.py) and its /set_internal_state key
(srt/managers/scheduler_components/internal_state.py): no server, no model,
no GPU. The TP agreement runs two ranks over a real gloo group.
"""

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")

import asyncio
import datetime
import json
import multiprocessing
import os
import tempfile
import time
import types
import unittest
from unittest import mock

from sglang.srt.managers import io_struct
from sglang.srt.managers.scheduler_components import internal_state
from sglang.srt.speculative.adaptive_runtime_state import (
    AdaptiveController,
    AdaptiveUpdateFenced,
    AdaptiveUpdateRejected,
    AdaptiveUpdateStale,
    SpecRuntimeState,
    ZeroStepGate,
    parse_runtime_update,
)
from sglang.srt.speculative.adaptive_spec_params import (
    DEFAULT_ADAPTIVE_CONFIG,
    MAX_ADAPTIVE_SLOTS,
    AdaptiveSpeculativeParams,
    normalize_adaptive_config,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.test.test_utils import CustomTestCase

GRAPH_BS = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48]
STARTUP_STEPS = 3


def write_config(cfg) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(cfg, handle)
    return handle.name


def make_params(cfg=None) -> AdaptiveSpeculativeParams:
    path = None if cfg is None else write_config(cfg)
    try:
        return AdaptiveSpeculativeParams(initial_steps=STARTUP_STEPS, cfg_path=path)
    finally:
        if path is not None:
            os.unlink(path)


def _state(steps):
    return SpecRuntimeState(steps, steps + 1, None, None, object(), None, None, None)


class FakeEagleWorker:
    """The attributes of EAGLEWorkerV2 the controller and handler touch; it
    records the CUDA-graph sizes each step's state was asked to capture."""

    def __init__(self, cfg=None, graph_bs=GRAPH_BS):
        self.speculative_num_steps = STARTUP_STEPS
        self.speculative_num_draft_tokens = STARTUP_STEPS + 1
        # The startup state is captured over every graph size.
        self.captured = {STARTUP_STEPS: None if graph_bs is None else list(graph_bs)}
        self.adaptive_controller = AdaptiveController(self, make_params(cfg))
        self.adaptive_controller.register(_state(STARTUP_STEPS))
        self.adaptive_controller.init_states(cuda_graph_bs=graph_bs)

    def build_adaptive_runtime_state(self, speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
        self.captured[speculative_num_steps] = cuda_graph_bs
        return _state(speculative_num_steps)

    def apply_runtime_state(self, state):
        self.speculative_num_steps = state.speculative_num_steps
        self.speculative_num_draft_tokens = state.speculative_num_draft_tokens


def fake_scheduler(worker, algorithm="EAGLE3"):
    """What SchedulerInternalStateController reads of the Scheduler."""
    return types.SimpleNamespace(
        spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
        draft_worker=worker,
        dp_tp_cpu_group=None,
        metrics_reporter=types.SimpleNamespace(spec_total_num_forward_ct=0, spec_total_num_accept_tokens=0),
    )


def gate_args(**fields):
    return {f"speculative_adaptive_{name}": value for name, value in fields.items()}


def set_state(controller, server_args):
    """SetInternalStateReq through msgpack (the ZMQ hop) into the handler."""
    request = io_struct.msgpack_decode(io_struct.msgpack_encode(io_struct.SetInternalStateReq(server_args=server_args)))
    reply = controller.set_internal_state(request)
    return io_struct.msgpack_decode(io_struct.msgpack_encode(reply)).updated


def single_rank():
    return mock.patch.object(internal_state, "get_parallel", lambda: types.SimpleNamespace(pp_size=1))


class TestStartupSchema(CustomTestCase):
    """The startup config is checked before any slot is built."""

    def test_the_default_and_comments_pass_and_keys_become_canonical(self):
        self.assertEqual(normalize_adaptive_config(DEFAULT_ADAPTIVE_CONFIG), DEFAULT_ADAPTIVE_CONFIG)
        clean = normalize_adaptive_config({"_why": "x", "strategy": "ema", "08": {"candidate_steps": [0, 1]}})
        self.assertEqual(clean, {"strategy": "ema", "8": {"candidate_steps": [0, 1]}})

    def test_unknown_keys_duplicates_and_other_strategies_are_refused(self):
        for cfg, words in (
            ({"1": {"candidate_steps": [1]}, "ema_aplha": 0.5}, "unknown top-level"),
            ({"1": {"candidate_steps": [1], "ema_aplha": 0.5}}, "unknown keys"),
            ({"1": {"candidate_steps": [1]}, "01": {"candidate_steps": [3]}}, "same"),
            ({"1": {"candidate_steps": [1]}, "strategy": "throughput_aware"}, "ema"),
            ({"_only": "comments"}, "at least one"),
            ([1, 2], "JSON object"),
        ):
            with self.subTest(cfg=cfg), self.assertRaisesRegex(ValueError, words):
                normalize_adaptive_config(cfg)

    def test_every_knob_is_bounded(self):
        bad = {
            "ema_alpha": [0, 1.5, float("nan"), True],
            "update_interval": [0, 2**31, 1.5],
            "warmup_batches": [-1, 10**400],
            "down_hysteresis": [-65, float("inf")],
            "up_hysteresis": [65],
            "ceiling_coeff": [1e308, -1],
        }
        for knob, values in bad.items():
            for value in values:
                cfg = {"1": {"candidate_steps": [1], knob: value}}
                with self.subTest(knob=knob, value=value), self.assertRaisesRegex(ValueError, knob):
                    normalize_adaptive_config(cfg)
        for steps in ([], [65], [-1], [True], list(range(66)), "1"):
            with self.subTest(steps=steps), self.assertRaises(ValueError):
                normalize_adaptive_config({"1": {"candidate_steps": steps}})

    def test_the_slot_count_is_bounded_and_building_is_linear(self):
        slot = {"candidate_steps": [0, 1, 3], "ema_alpha": 0.3}
        at_bound = {str(bs): dict(slot) for bs in range(1, MAX_ADAPTIVE_SLOTS + 1)}
        past = {**at_bound, str(MAX_ADAPTIVE_SLOTS + 1): dict(slot)}
        with self.assertRaisesRegex(ValueError, str(MAX_ADAPTIVE_SLOTS)):
            normalize_adaptive_config(past)
        start = time.perf_counter()
        params = make_params({**at_bound, "warmup_batches": 0})
        self.assertLess(time.perf_counter() - start, 2.0)
        # Top-level knobs are slot defaults; slots keep their own.
        slot_1 = params._slots[1]
        self.assertEqual((slot_1.ema_alpha, slot_1.warmup_batches), (0.3, 0))


class TestUpdateFields(CustomTestCase):
    def test_types_and_bounds(self):
        self.assertEqual(
            parse_runtime_update({"zero_steps_above_bs": -1, "fence": 7}),
            dict(
                set_zero_steps_above_bs=True,
                zero_steps_above_bs=None,
                gate_min_dwell_steps=None,
                expected_generation=None,
                fence=7,
            ),
        )
        for fields in (
            {},
            {"fence": 3},
            {"zero_steps_above_bs": -2},
            {"zero_steps_above_bs": 1.0},
            {"zero_steps_above_bs": True},
            {"zero_steps_above_bs": 2**31},
            {"gate_min_dwell_steps": 100_001},
            {"zero_steps_above_bs": 4, "fence": 10**18},
            {"zero_steps_above_bs": 4, "expected_generation": -1},
        ):
            with self.subTest(fields=fields), self.assertRaises(AdaptiveUpdateRejected):
                parse_runtime_update(fields)


class TestZeroStepGate(CustomTestCase):
    def test_the_gate_holds_for_its_dwell_and_logs_at_most_once_a_minute(self):
        now = [0.0]
        gate = ZeroStepGate(clock=lambda: now[0])
        gate.configure(16, 4)
        decisions = [gate.decide(bs) for bs in (20, 10, 10, 10, 10, 20, 20)]
        self.assertEqual(decisions, [True, True, True, True, False, False, False])
        self.assertEqual(gate.flips, 2)
        with self.assertLogs("sglang.srt.speculative.adaptive_runtime_state", "INFO") as logs:
            gate.configure(16, 0)
            for bs in (20, 10, 20, 10):
                gate.decide(bs)
            now[0] = 61.0
            gate.decide(20)
        self.assertEqual(len(logs.output), 1)
        self.assertIn("flips since the last line", logs.output[0])


class TestControllerGate(CustomTestCase):
    def setUp(self):
        self.worker = FakeEagleWorker()
        self.controller = self.worker.adaptive_controller

    def test_batches_above_the_gate_run_zero_steps_and_teach_no_slot(self):
        self.controller.update_runtime_policy(
            set_zero_steps_above_bs=True, zero_steps_above_bs=4, gate_min_dwell_steps=0
        )
        self.controller.activate_step_by_batch(6)
        self.assertEqual(self.worker.speculative_num_steps, 0)
        slot = self.controller.params._route(6)
        before = (slot.ema_accept_len, slot._batch_count)
        self.controller.on_verify_complete([0] * 6, 6)
        self.assertEqual((slot.ema_accept_len, slot._batch_count), before)
        self.controller.activate_step_by_batch(3)
        self.assertEqual(self.worker.speculative_num_steps, STARTUP_STEPS)
        self.controller.update_runtime_policy(set_zero_steps_above_bs=True, zero_steps_above_bs=None)
        self.controller.activate_step_by_batch(6)
        self.assertEqual(
            self.worker.speculative_num_steps,
            self.controller.params.get_steps_for_batch(6),
        )

    def test_a_gate_needing_an_uncaptured_step_or_graph_is_refused(self):
        no_zero = FakeEagleWorker({"1": {"candidate_steps": [1, 3]}}).adaptive_controller
        with self.assertRaisesRegex(AdaptiveUpdateRejected, "0-step runtime state"):
            no_zero.update_runtime_policy(set_zero_steps_above_bs=True, zero_steps_above_bs=4)
        # Step 0 captured at graph sizes 1-4 only (the slot "1" reaches 1..4).
        small_zero = FakeEagleWorker(
            {"1": {"candidate_steps": [0, 3]}, "8": {"candidate_steps": [3]}}
        ).adaptive_controller
        with self.assertRaisesRegex(AdaptiveUpdateRejected, r"\[8, 12, .*48\]"):
            small_zero.update_runtime_policy(set_zero_steps_above_bs=True, zero_steps_above_bs=4)
        self.assertEqual((small_zero.generation, small_zero.gate.threshold), (0, None))

    def test_the_fence_and_the_generation(self):
        c = self.controller
        c.update_runtime_policy(set_zero_steps_above_bs=True, zero_steps_above_bs=8, fence=6)
        with self.assertRaisesRegex(AdaptiveUpdateFenced, "fence 5, but fence 6"):
            c.update_runtime_policy(set_zero_steps_above_bs=True, zero_steps_above_bs=2, fence=5)
        # A refused, stale or dry-run update never raises the fence.
        with self.assertRaises(AdaptiveUpdateStale):
            c.update_runtime_policy(gate_min_dwell_steps=0, expected_generation=0, fence=10**17)
        gap = mock.patch.object(c, "graph_gaps", return_value=[8])
        with gap, self.assertRaisesRegex(AdaptiveUpdateRejected, "eager"):
            c.update_runtime_policy(set_zero_steps_above_bs=True, zero_steps_above_bs=4, fence=10**17)
        self.assertEqual((c.fence_highest, c.fence_refused, c.generation), (6, 1, 1))
        self.assertEqual(c.gate.threshold, 8)
        c.update_runtime_policy(
            set_zero_steps_above_bs=True,
            zero_steps_above_bs=16,
            fence=6,
            expected_generation=1,
        )
        state = c.runtime_state()
        self.assertEqual(
            (state["generation"], state["zero_steps_above_bs"], state["fence"]),
            (2, 16, {"highest": 6, "refused": 1}),
        )

    def test_a_failing_decision_keeps_the_step(self):
        with (
            mock.patch.object(self.controller.params, "get_steps_for_batch", side_effect=RuntimeError),
            self.assertLogs(level="ERROR"),
        ):
            self.controller.activate_step_by_batch(8)
        self.controller.params.on_verify_complete = lambda *_: 99  # no such state
        self.controller.on_verify_complete([1], 1)
        self.assertEqual(self.worker.speculative_num_steps, STARTUP_STEPS)
        self.assertEqual(self.controller.decision_errors, 2)


class TestTheDwellStaysInsideTheGraphs(CustomTestCase):
    """Every admitted gate x dwell x config: each batch runs a step whose state
    captured a graph it can pad to (judged on what the worker was asked to
    capture, not on the controller's own bookkeeping)."""

    CONFIGS = (
        None,
        {"1": {"candidate_steps": [0, 1, 3, 5]}, "16": {"candidate_steps": [0, 3]}},
        {"1": {"candidate_steps": [3, 5]}, "8": {"candidate_steps": [0, 1, 3]}},
        # Step 0 captured at graph sizes 1-4 only: admitted gates are the
        # largest ones, and the dwell must not hold 0 steps at batch 40.
        {"1": {"candidate_steps": [0, 3]}, "8": {"candidate_steps": [3]}},
    )

    def test_sweep(self):
        sizes = [1, 3, 5, 9, 13, 17, 30, 40, 45, 48, 60, 40, 20, 9, 2, 55, 47, 1, 33]
        admitted = 0
        for cfg in self.CONFIGS:
            for gate in range(0, 50):
                for dwell in (0, 1, 3, 32):
                    worker = FakeEagleWorker(cfg)
                    controller = worker.adaptive_controller
                    try:
                        controller.update_runtime_policy(
                            set_zero_steps_above_bs=True,
                            zero_steps_above_bs=gate,
                            gate_min_dwell_steps=dwell,
                        )
                    except AdaptiveUpdateRejected:
                        continue
                    admitted += 1
                    for bs in sizes:
                        controller.activate_step_by_batch(bs)
                        if bs > GRAPH_BS[-1]:
                            continue  # past every graph: eager at any step
                        have = worker.captured[worker.speculative_num_steps]
                        with self.subTest(cfg=cfg, gate=gate, dwell=dwell, bs=bs):
                            self.assertTrue(have and max(have) >= bs, have)
        self.assertGreater(admitted, 300)


class TestSetInternalState(CustomTestCase):
    """The "speculative_adaptive" key of /set_internal_state in the real
    SchedulerInternalStateController, the request crossing msgpack."""

    def setUp(self):
        self.enterContext(single_rank())
        self.worker = FakeEagleWorker()
        self.state = internal_state.SchedulerInternalStateController(
            fake_scheduler(self.worker), record_step_time=False
        )
        self.controller = self.worker.adaptive_controller

    def readback(self):
        state = {}
        self.state._add_speculative(state)
        return state["speculative_adaptive"]

    def test_applied_then_read_back(self):
        self.assertTrue(set_state(self.state, gate_args(zero_steps_above_bs=8)))
        back = self.readback()
        self.assertEqual((back["zero_steps_above_bs"], back["generation"]), (8, 1))
        self.assertEqual(back["last_update"]["result"], "applied")

    def test_refusals_say_why_and_change_nothing(self):
        self.assertTrue(set_state(self.state, gate_args(zero_steps_above_bs=8, fence=9)))
        for fields, reason in (
            (dict(zero_steps_above_bs=-5), "rejected"),
            (dict(fence=10), "rejected"),  # nothing to change
            (dict(zero_steps_above_bs=4, fence=3), "fenced"),
            (dict(zero_steps_above_bs=4, expected_generation=0), "stale_generation"),
        ):
            with self.subTest(fields=fields):
                self.assertFalse(set_state(self.state, gate_args(**fields)))
                back = self.readback()
                self.assertEqual(back["last_update"]["reason"], reason)
                self.assertEqual((back["zero_steps_above_bs"], back["generation"]), (8, 1))
                self.assertEqual(back["fence"]["highest"], 9)
        # With another key: refused before anything applies.
        self.assertFalse(
            set_state(
                self.state,
                {**gate_args(zero_steps_above_bs=4), "pp_max_micro_batch_size": 1},
            )
        )
        self.assertEqual(self.controller.gate.threshold, 8)

    def test_not_applicable_without_adaptive(self):
        self.worker.adaptive_controller = None
        self.assertFalse(set_state(self.state, gate_args(zero_steps_above_bs=8)))
        state = {}
        self.state._add_speculative(state)
        self.assertNotIn("speculative_adaptive", state)

    def test_the_http_route_answers_through_the_tokenizer_side(self):
        """The release's own /set_internal_state route and tokenizer method."""
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.communicator import FanOutCommunicator
        from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin

        state = self.state

        class Tokenizer(TokenizerControlMixin):
            def __init__(self):
                self.set_internal_state_communicator = FanOutCommunicator(self._send, 1)

            def auto_create_handle_loop(self):
                pass

            def _send(self, obj):
                reply = state.set_internal_state(io_struct.msgpack_decode(io_struct.msgpack_encode(obj)))
                asyncio.get_running_loop().call_soon(self.set_internal_state_communicator.handle_recv, reply)

        global_state = types.SimpleNamespace(tokenizer_manager=Tokenizer())
        with mock.patch.object(http_server, "_global_state", global_state):
            body = io_struct.SetInternalStateReq(server_args=gate_args(zero_steps_above_bs=0, gate_min_dwell_steps=4))
            self.assertEqual(asyncio.run(http_server.set_internal_state(body, None)), [True])
        self.assertEqual(
            (self.controller.gate.threshold, self.controller.gate.min_dwell_steps),
            (0, 4),
        )

    def test_a_non_numeric_value_is_refused_by_the_request_type(self):
        """server_args is Dict[str, int | float]: a nested value never decodes."""
        import msgspec

        with self.assertRaises(msgspec.ValidationError):
            set_state(self.state, {"speculative_adaptive_zero_steps_above_bs": {"n": 1}})


# -- TP agreement over a real gloo group --------------------------------------

WORLD = 2
GLOO_TIMEOUT_S = 60
# Where rank 1 raises: before the update (the snapshot), inside it (the gate's
# configure), after it (the digest, between the update and the vote).
SCENARIOS = (None, "snapshot", "configure", "policy_digest")


def _rank(rank, init_file, out):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
    )
    results = []
    with single_rank():
        for where in SCENARIOS:
            worker = FakeEagleWorker()
            scheduler = fake_scheduler(worker)
            scheduler.dp_tp_cpu_group = dist.group.WORLD
            state = internal_state.SchedulerInternalStateController(scheduler, False)
            controller = worker.adaptive_controller
            update = gate_args(zero_steps_above_bs=8, fence=7)
            if rank == 1 and where is not None:
                target = controller.gate if where == "configure" else controller

                def fail(*_args, _where=where, **_kwargs):
                    raise RuntimeError(f"injected in {_where} on rank {rank}")

                with mock.patch.object(target, where, fail):
                    updated = set_state(state, update)
            else:
                updated = set_state(state, update)
            results.append(
                (
                    updated,
                    controller.last_update["reason"],
                    controller.generation,
                    controller.fence_highest,
                    controller.gate.threshold,
                )
            )
    out.put((rank, results))
    dist.destroy_process_group()


class TestTPAgreementOverGloo(CustomTestCase):
    def test_no_hang_and_every_rank_rolls_back_together(self):
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "init")
            procs = [ctx.Process(target=_rank, args=(rank, init_file, out)) for rank in range(WORLD)]
            for proc in procs:
                proc.start()
            results = dict(out.get(timeout=240) for _ in range(WORLD))
            for proc in procs:
                proc.join(timeout=60)
                self.assertEqual(proc.exitcode, 0)
        applied = (True, "", 1, 7, 8)
        rolled_back = (False, "failed", 0, None, None)
        expected = [applied] + [rolled_back] * (len(SCENARIOS) - 1)
        self.assertEqual(results[0], expected)
        self.assertEqual(results[1], expected)


if __name__ == "__main__":
    unittest.main()

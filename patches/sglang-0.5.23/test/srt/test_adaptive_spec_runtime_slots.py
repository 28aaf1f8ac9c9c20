"""Slot replacement (runtime-speculation-slots.patch, on top of the gate): the POST fields `config` and
`reset_config`, `validate_runtime_adaptive_config`, `AdaptiveSpeculativeParams.replace_config` /
`startup_config`, and the controller refusing a policy whose graphs were never captured. CPU only; the fakes
are the gate suites' (policy, controller, endpoint).
"""

import json
import time
import unittest

import test_adaptive_spec_runtime_endpoint as endpoint
import test_adaptive_spec_runtime_policy as policy
from sglang.srt.managers.scheduler_components import internal_state
from sglang.srt.speculative import adaptive_spec_params as asp
from sglang.srt.speculative.adaptive_runtime_state import AdaptiveUpdateConflict
from sglang.srt.speculative.adaptive_spec_params import (
    DEFAULT_ADAPTIVE_CONFIG,
    parse_runtime_update_body,
    validate_runtime_adaptive_config,
)
from test_adaptive_spec_runtime_controller import started_controller
from test_adaptive_spec_runtime_policy import INITIAL_STEPS, REFUSED_CONFIGS, load_startup, make_params


class TestPatchedTree(unittest.TestCase):
    def test_patched_module_is_imported(self):
        # Guard against testing a tree with the gate patch only.
        self.assertTrue(hasattr(asp, "validate_runtime_adaptive_config"))


class TestValidateRuntimeConfig(unittest.TestCase):
    CAPTURED = (0, 1, 3, 5, 7)  # union of DEFAULT_ADAPTIVE_CONFIG

    def test_accepts_slots_over_captured_steps(self):
        cfg = {
            "ema_alpha": 0.3,
            "1": {"candidate_steps": [3, 7]},
            "16": {"candidate_steps": [0]},
            "_comment": "ignored",
        }
        self.assertEqual(sorted(validate_runtime_adaptive_config(cfg, self.CAPTURED)), [1, 16])

    def test_rejects_step_count_not_captured(self):
        with self.assertRaisesRegex(ValueError, r"BS 1: candidate_steps \[2, 4\]"):
            validate_runtime_adaptive_config({"1": {"candidate_steps": [2, 3, 4]}}, self.CAPTURED)

    def test_rejects_malformed_input_with_the_offending_key(self):
        bad = [
            ({"1": {"candidate_steps": [True]}}, "candidate_steps must be"),
            ({"1": {"candidate_steps": [1], "ema": 0.1}}, r"unknown keys \['ema'\]"),
            ({"1": {"candidate_steps": [1], "ema_alpha": 0}}, "ema_alpha must be"),
            ({"1": {"candidate_steps": [1], "update_interval": 0}}, "update_interval"),
            ({"steps": [1]}, "unknown top-level key 'steps'"),
            ({"1": [1, 3]}, "slot must be a JSON object"),
            ({}, "at least one integer-string"),
            ([1, 3], "config must be a JSON object"),
        ]
        for cfg, pattern in bad:
            with self.subTest(cfg=cfg), self.assertRaisesRegex(ValueError, pattern):
                validate_runtime_adaptive_config(cfg, self.CAPTURED)


class TestOneSchema(unittest.TestCase):
    """The startup file and a runtime `config` go through one normalizer."""

    def test_a_startup_file_with_comments_can_be_reset_to(self):
        p, union = load_startup({"_comment": "tuned", "ema_alpha": 0.3, "01": {"candidate_steps": [0, 3], "_why": "x"}})
        self.assertEqual(union, [0, 3])
        self.assertEqual(p.startup_config, {"ema_alpha": 0.3, "1": {"candidate_steps": [0, 3]}})
        validate_runtime_adaptive_config(p.startup_config, union)  # what reset_config checks

    def test_what_the_startup_refuses_the_runtime_refuses(self):
        for cfg, pattern in REFUSED_CONFIGS:
            with self.subTest(cfg=cfg), self.assertRaisesRegex(ValueError, pattern):
                parse_runtime_update_body({"config": cfg})


class TestReplaceConfig(unittest.TestCase):
    def test_unchanged_slot_keeps_state_changed_slot_restarts(self):
        p = make_params()
        slot1 = p._slots[1]
        for _ in range(40):  # high acceptance at bs=1 moves slot "1" up
            p.on_verify_complete([7], batch_size=1)
        learned = (slot1.current_steps, slot1.ema_accept_len)
        self.assertGreater(learned[0], INITIAL_STEPS)

        new_cfg = dict(DEFAULT_ADAPTIVE_CONFIG)
        new_cfg["8"] = {**DEFAULT_ADAPTIVE_CONFIG["8"], "candidate_steps": [0, 1]}
        p.replace_config(new_cfg)

        self.assertIs(p._slots[1], slot1)
        self.assertEqual((slot1.current_steps, slot1.ema_accept_len), learned)
        # Old slot "8" was at 3, no longer a candidate: middle candidate, fresh EMA.
        self.assertEqual(p._slots[8].candidate_steps, [0, 1])
        self.assertEqual(p._slots[8].current_steps, 1)
        self.assertEqual(p._slots[8]._batch_count, 0)
        self.assertEqual(p.candidate_steps, [0, 1, 3, 5, 7])  # cache dropped

    def test_config_round_trips_and_reset_restores_startup(self):
        p = make_params()
        startup = p.config()
        p.replace_config({"1": {"candidate_steps": [1]}, "4": {"candidate_steps": [0]}})
        self.assertEqual(sorted(p.config()), ["1", "4"])
        self.assertEqual(p.get_steps_for_batch(8), 0)
        p.replace_config(p.startup_config)
        self.assertEqual(p.config(), startup)
        # What GET returns is a valid POST body.
        validate_runtime_adaptive_config(p.config(), [0, 1, 3, 5, 7])


class TestParseBody(unittest.TestCase):
    def test_config_alone_leaves_the_gate(self):
        kept = parse_runtime_update_body({"config": {"1": {"candidate_steps": [1]}}})
        self.assertFalse(kept["set_zero_steps_above_bs"])

    def test_rejects_bad_config_bodies_before_they_reach_the_scheduler(self):
        bad = [
            ({"expected_generation": 2**70, "reset_config": True}, "expected_generation"),
            ({"config": {"1": {"candidate_steps": [1]}}, "reset_config": True}, "not both"),
            ({"config": {}}, "at least one integer-string BS key"),
            ({"config": {"1": {"candidate_steps": [10**30]}}}, r"at most 65 ints in \[0, 64\]"),
            ({"config": {"1": {"candidate_steps": [1], "update_interval": 0}}}, "update_interval"),
            ({"config": {"1": {"candidate_steps": [1], "ema_alpha": float("nan")}}}, "ema_alpha"),
            ({"config": {"1": {"candidate_steps": [True]}}}, r"at most 65 ints in \[0, 64\]"),
            ({"config": {"1": {"candidate_steps": [1], "ceiling_coeff": 1e308}}}, "ceiling_coeff"),
            ({"config": {"1": [1]}}, "JSON object"),
        ]
        for body, pattern in bad:
            with self.subTest(body=body), self.assertRaisesRegex(ValueError, pattern):
                parse_runtime_update_body(body)

    def test_config_crosses_to_the_scheduler_cleaned(self):
        # Comment keys (which could nest anything) stop in the HTTP process; BS keys are canonical.
        deep = {}
        for _ in range(5000):
            deep = {"x": deep}
        fields = parse_runtime_update_body(
            {"config": {"_note": deep, "ema_alpha": 0.5, "08": {"candidate_steps": [0, 1], "_why": "x"}}}
        )
        self.assertEqual(fields["config"], {"ema_alpha": 0.5, "8": {"candidate_steps": [0, 1]}})


class TestControllerConfig(unittest.TestCase):
    def test_rejected_update_changes_nothing(self):
        _worker, c = started_controller()
        before = c.runtime_config()
        bad = [
            dict(config={"1": {"candidate_steps": [2]}}),
            dict(config={"1": {"candidate_steps": [7]}, "8": {"candidate_steps": [7]}}),
        ]
        for kwargs in bad:
            with self.subTest(kwargs=kwargs), self.assertRaises(ValueError):
                c.update_runtime_config(**kwargs)
        self.assertEqual(c.runtime_config(), before)

    def test_a_policy_that_would_run_eager_is_refused(self):
        _worker, c = started_controller()
        cfg = {"1": {"candidate_steps": [7]}, "8": {"candidate_steps": [7]}}
        with self.assertRaisesRegex(ValueError, "steps=7 at cuda-graph bs"):
            c.update_runtime_config(config=cfg)
        with self.assertRaises(TypeError):  # no switch to allow it any more
            c.update_runtime_config(config=cfg, allow_eager_fallback=True)
        self.assertEqual((c.generation, c.params.config()["1"]["candidate_steps"]), (0, [1, 3, 5, 7]))

    def test_reset_config_is_compare_and_set(self):
        _worker, c = started_controller()
        startup = c.params.config()
        c.update_runtime_config(config={"1": {"candidate_steps": [1]}}, expected_generation=0)
        with self.assertRaises(AdaptiveUpdateConflict):
            c.update_runtime_config(reset_config=True, expected_generation=0)
        c.update_runtime_config(reset_config=True, expected_generation=1)
        self.assertEqual((c.generation, c.params.config()), (2, startup))

    def test_the_dwell_never_runs_a_replaced_slot_outside_its_graphs(self):
        """The review's case: slots replaced so a small-batch slot runs a deep step captured only at small sizes,
        and a gate that covers it; the dwell would have held that step at batch 40 (no graph: eager)."""
        from test_adaptive_spec_runtime_controller import outside_the_graphs

        worker, controller = started_controller()
        self.assertEqual(controller._captured_graph_bs[5], [1, 2, 4])
        controller.update_runtime_config(
            config={"1": {"candidate_steps": [0, 5]}},
            set_zero_steps_above_bs=True,
            zero_steps_above_bs=4,
            gate_min_dwell_steps=32,
        )
        # Engaged at 40, released after the dwell at 2 (step 5), then 40 again inside the new dwell.
        self.assertEqual(outside_the_graphs(worker, controller, [40] + [2] * 40 + [40, 40]), [])
        self.assertEqual(worker.speculative_num_steps, 0)

    def test_graphs_disabled_accepts_any_captured_step(self):
        worker, c = started_controller(graph_bs=None)
        c.update_runtime_config(config={"1": {"candidate_steps": [7]}})
        c.activate_step_by_batch(40)
        self.assertEqual(worker.speculative_num_steps, 7)

    def test_restore_undoes_slots_gate_and_generation(self):
        worker, c = started_controller()
        before, digest = c.runtime_config(), c.policy_digest()
        snapshot = c.snapshot()
        c.update_runtime_config(
            config={"1": {"candidate_steps": [1]}, "4": {"candidate_steps": [0]}},
            set_zero_steps_above_bs=True,
            zero_steps_above_bs=8,
        )
        self.assertNotEqual(c.policy_digest(), digest)
        c.restore(snapshot)
        self.assertEqual(c.runtime_config(), before)
        c.activate_step_by_batch(20)
        self.assertEqual(worker.speculative_num_steps, 3)


class TestConfigOverControlPath(endpoint.ControlPathCase):
    def test_config_rejections_map_to_http_status(self):
        status, body = self.post({"config": {"1": {"candidate_steps": [2]}}})
        self.assertEqual((status, body["reason"]), (400, "rejected"))
        self.assertIn("only the step counts captured at startup", body["message"])

        status, body = self.post({"reset_config": True, "expected_generation": 5})
        self.assertEqual((status, body["reason"]), (409, "stale_generation"))
        self.assertEqual(self.get()[1]["state"]["generation"], 0)

        sent = len(self.tm.sent)
        self.assertEqual(self.post({"config": {"1": {"candidate_steps": [1], "ema_alpha": 2}}})[0], 400)
        self.assertEqual(len(self.tm.sent), sent)  # a malformed config never reaches the scheduler

    def test_metrics_follow_every_update(self):
        collector = self.tm.scheduler.metrics_collector
        self.post({"zero_steps_above_bs": 16})
        self.post({"config": {"1": {"candidate_steps": [2]}}})
        self.post({"reset_config": True, "expected_generation": 0})
        self.assertEqual(collector.updates, ["applied", "rejected", "conflict"])
        self.assertEqual(collector.policy[-1], (16, 1))

    def test_get_is_a_postable_config(self):
        state = self.get()[1]["state"]
        status, body = self.post({"config": state["config"], "expected_generation": state["generation"]})
        self.assertEqual(status, 200, body)
        self.assertEqual(body["states"][0]["config"], state["config"])

    def test_a_config_at_the_slot_bound_applies_and_decisions_stay_cheap_past_it_400(self):
        """The review's ~1 MB POST of 40,000 slots froze decoding for minutes: now it is refused in the HTTP
        process; a config at the bound is applied in well under a second and every decision stays cheap."""
        huge = {"config": {str(bs): {"candidate_steps": [3]} for bs in range(1, 40_001)}}
        status, body = self.post(huge)
        self.assertEqual((status, body["reason"]), (400, "invalid_body"))
        self.assertIn("body too large", body["message"])
        over = {"config": {str(bs): {"candidate_steps": [3]} for bs in range(1, asp.MAX_ADAPTIVE_SLOTS + 2)}}
        status, body = self.post(over)
        self.assertEqual((status, body["reason"]), (400, "invalid_body"))
        self.assertIn(f"more than {asp.MAX_ADAPTIVE_SLOTS} BS slots", body["message"])
        self.assertEqual(self.tm.sent, [])

        knobs = {"ema_alpha": 0.5, "update_interval": 1, "warmup_batches": 0, "down_hysteresis": 0.0}
        at = {str(bs): {"candidate_steps": [3], **knobs} for bs in range(1, asp.MAX_ADAPTIVE_SLOTS + 1)}
        self.assertLessEqual(len(json.dumps({"config": at})), endpoint.http_server.MAX_SPEC_ADAPTIVE_BODY_BYTES)
        started = time.perf_counter()
        status, body = self.post({"config": at})
        self.assertEqual(status, 200, body)
        self.assertLess(time.perf_counter() - started, policy.BUILD_BOUND_S)
        self.assertEqual(len(body["state"]["config"]), asp.MAX_ADAPTIVE_SLOTS)

        controller = self.worker.adaptive_controller
        started = time.perf_counter()
        for bs in range(1, 2001):
            controller.activate_step_by_batch(bs % 48 + 1)
            controller.on_verify_complete([2, 3, 1], bs % 48 + 1)
        self.assertLess((time.perf_counter() - started) / 2000, policy.DECISION_BOUND_S)
        self.assertEqual(controller.decision_errors, 0)


class TestConfigOverTwoRanks(endpoint.TwoRanksCase):
    def test_a_rank_local_failure_in_replace_config_rolls_every_rank_back(self):
        before = self.policies()

        def fail(*_args, **_kwargs):
            raise RuntimeError("injected on rank 1")

        self.workers[1].adaptive_controller.params.replace_config = fail
        with self.assertLogs(internal_state.logger, "ERROR"):
            replies = self.broadcast(
                self.update(
                    config={"1": {"candidate_steps": [1, 3]}, "8": {"candidate_steps": [0]}},
                    set_zero_steps_above_bs=True,
                    zero_steps_above_bs=8,
                )
            )
        self.assertEqual([(r.success, r.reason) for r in replies], [(False, "failed")] * 2)
        self.assertEqual(self.policies(), before)
        self.assertEqual([w.adaptive_controller.generation for w in self.workers], [0, 0])

    def test_a_rejection_alike_on_every_rank_is_a_rejection(self):
        replies = self.broadcast(self.update(config={"1": {"candidate_steps": [2]}}))
        self.assertEqual([(r.success, r.reason) for r in replies], [(False, "rejected")] * 2)


if __name__ == "__main__":
    unittest.main()

"""Pure policy logic of the runtime adaptive-spec patch (no GPU, no server): the one config
schema and its bounds, the zero-step gate and its dwell, slot replacement, graph coverage, the POST body.

Needs only the patched sglang tree on PYTHONPATH (plus a `triton` import stub,
because `sglang/__init__` imports it); run with `python -m unittest`.
"""

import itertools
import json
import random
import tempfile
import time
import unittest
from unittest import mock

from sglang.srt.speculative import adaptive_spec_params as asp
from sglang.srt.speculative.adaptive_spec_params import (
    DEFAULT_ADAPTIVE_CONFIG,
    AdaptiveSpeculativeParams,
    AdaptiveStepSlot,
    ZeroStepGate,
    graph_coverage_gaps,
    normalize_adaptive_config,
    parse_runtime_update_body,
    resolve_candidate_steps_from_config,
    validate_zero_steps_above_bs,
)

# Decode CUDA-graph batch sizes of an EAGLE server at max_running_requests=48
# (illustrative; the real list comes from --cuda-graph-bs / max bs).
GRAPH_BS = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48]
INITIAL_STEPS = 3  # startup --speculative-num-steps; must be a candidate


def load_startup(cfg):
    """Params and the captured-step union from `cfg` as a --speculative-adaptive-config file."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(cfg, f)
        f.flush()
        params = AdaptiveSpeculativeParams(initial_steps=INITIAL_STEPS, cfg_path=f.name)
        return params, resolve_candidate_steps_from_config(f.name)


def make_params(cfg=None):
    p = load_startup(cfg)[0] if cfg is not None else AdaptiveSpeculativeParams(initial_steps=INITIAL_STEPS)
    p.set_cuda_graph_bs(GRAPH_BS)
    return p


# Refused by the one normalizer: in a startup file here, in a runtime `config` body in the slots suite.
REFUSED_CONFIGS = (
    ({"1": {"candidate_steps": [1]}, "typo_key": 1}, "unknown top-level key 'typo_key'"),
    ({"1": {"candidate_steps": [1], "ema_aplha": 0.1}}, "unknown keys"),
    ({"1": {"candidate_steps": [1]}, "01": {"candidate_steps": [3]}}, "name the same batch size"),
    ({"1": {"candidate_steps": [1], "ceiling_coeff": 1e308}}, "ceiling_coeff"),
)


def startup_capture(params):
    """step -> graph bs, as AdaptiveController.init_states records it: the
    startup step over every graph bs, every other step over its pruned list."""
    captured = {INITIAL_STEPS: list(GRAPH_BS)}
    for step in params.candidate_steps:
        captured.setdefault(step, params.cuda_graph_bs_for_step(step))
    return captured


class TestPatchedTree(unittest.TestCase):
    def test_patched_module_is_imported(self):
        # Guard against silently testing an unpatched installed sglang.
        self.assertTrue(hasattr(asp, "parse_runtime_update_body"))


class TestValidateGate(unittest.TestCase):
    def test_gate_needs_the_zero_step_state(self):
        validate_zero_steps_above_bs(16, [0, 3])
        validate_zero_steps_above_bs(None, [3])
        with self.assertRaisesRegex(ValueError, "0-step runtime state"):
            validate_zero_steps_above_bs(16, [1, 3])
        for bad in (-1, True, 1.5, "16"):
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                validate_zero_steps_above_bs(bad, [0])


class TestGate(unittest.TestCase):
    def test_zero_steps_above_bs_then_back_on(self):
        p = make_params()
        self.assertEqual(p.get_steps_for_batch(20), 3)  # slot "8": [0, 1, 3]
        p.set_zero_steps_above_bs(16, min_dwell_steps=0)
        self.assertEqual(p.get_steps_for_batch(16), 3)
        self.assertEqual(p.get_steps_for_batch(17), 0)
        self.assertEqual(p.get_steps_for_batch(48), 0)
        p.set_zero_steps_above_bs(None)
        self.assertEqual(p.get_steps_for_batch(17), 3)

    def test_a_new_setting_applies_at_the_next_batch_whatever_the_dwell(self):
        p = make_params()
        p.set_zero_steps_above_bs(16, min_dwell_steps=1000)
        self.assertEqual(p.get_steps_for_batch(17), 0)
        p.set_zero_steps_above_bs(None)  # removing the gate never waits
        self.assertEqual(p.get_steps_for_batch(17), 3)
        p.set_zero_steps_above_bs(16)
        self.assertEqual(p.get_steps_for_batch(40), 0)
        p.set_zero_steps_above_bs(64)
        self.assertEqual(p.get_steps_for_batch(40), make_params().get_steps_for_batch(40))

    def test_gated_batches_do_not_feed_the_ema(self):
        p = make_params()
        p.set_zero_steps_above_bs(16)
        slot = p._route(20)
        before = (slot.ema_accept_len, slot._batch_count, slot.current_steps)
        for _ in range(50):
            self.assertEqual(p.get_steps_for_batch(20), 0)
            self.assertIsNone(p.on_verify_complete([0] * 20, batch_size=20))
        self.assertEqual((slot.ema_accept_len, slot._batch_count, slot.current_steps), before)

    def test_gate_zero_turns_every_batch_plain(self):
        p = make_params()
        p.set_zero_steps_above_bs(0)
        self.assertEqual({p.get_steps_for_batch(b) for b in range(1, 60)}, {0})


class TestGateHysteresis(unittest.TestCase):
    """A batch hovering at N flips the gate at most once per dwell, and says so at most once a minute."""

    STEPS = 1000

    def hover(self, dwell, n=16):
        p = make_params()
        p.set_zero_steps_above_bs(n, min_dwell_steps=dwell)
        steps = [p.get_steps_for_batch(n + (i % 2)) for i in range(self.STEPS)]
        return p, sum(a != b for a, b in itertools.pairwise(steps))

    def test_without_a_dwell_every_step_flips(self):
        _p, flips = self.hover(dwell=0)
        self.assertEqual(flips, self.STEPS - 1)

    def test_the_default_dwell_bounds_the_flips(self):
        p, flips = self.hover(dwell=asp.DEFAULT_GATE_MIN_DWELL_STEPS)
        self.assertGreater(flips, 0)
        self.assertLessEqual(flips, self.STEPS // asp.DEFAULT_GATE_MIN_DWELL_STEPS + 1)
        self.assertEqual(p.gate.flips, flips)
        for dwell in (1, 7, 100, asp.MAX_GATE_MIN_DWELL_STEPS):
            with self.subTest(dwell=dwell):
                self.assertLessEqual(self.hover(dwell)[1], self.STEPS // dwell + 1)

    def test_a_steady_load_is_not_delayed_by_the_dwell(self):
        p = make_params()
        p.set_zero_steps_above_bs(16)
        self.assertEqual([p.get_steps_for_batch(b) for b in (20, 20, 20)], [0, 0, 0])

    def test_flips_are_logged_at_most_once_per_interval(self):
        now = [0.0]
        lines = []
        gate = ZeroStepGate(clock=lambda: now[0])
        gate.configure(16, min_dwell_steps=0)
        with mock.patch.object(asp, "log_info_on_rank0", lambda _logger, msg: lines.append(msg)):
            for i in range(500):
                gate.decide(16 + (i % 2))
            self.assertEqual(len(lines), 1)
            now[0] += asp.GATE_LOG_INTERVAL_S
            gate.decide(16)
            gate.decide(17)
        self.assertEqual(len(lines), 2)
        self.assertIn("flips since the last line", lines[1])


class TestBounds(unittest.TestCase):
    """Every knob at its type's extremes is refused, or accepted and harmless in the decision loop."""

    EXTREMES = (
        1e308,
        -1e308,
        float("inf"),
        float("-inf"),
        float("nan"),
        5e-324,
        -5e-324,
        10**400,
        -(10**400),
        2**31,
        2**31 - 1,
        -(2**31),
        2**63,
        0,
        -1,
        1,
        0.5,
        True,
        None,
        "1",
        [],
        {},
    )

    def test_ceiling_coeff_1e308_would_crash_the_release_slot(self):
        # What the bound prevents: the unbounded knob raises inside the scheduler's result processing.
        slot = AdaptiveStepSlot(
            3, {"candidate_steps": [1, 3, 5], "ceiling_coeff": 1e308, "warmup_batches": 0, "update_interval": 1}
        )
        with self.assertRaises(OverflowError):
            for _ in range(5):
                slot.update([5])
        with self.assertRaisesRegex(ValueError, "ceiling_coeff"):
            normalize_adaptive_config({"1": {"candidate_steps": [1, 3, 5], "ceiling_coeff": 1e308}})

    def drive(self, cfg):
        p = make_params(cfg)
        p.set_zero_steps_above_bs(16, min_dwell_steps=3)
        rng = random.Random(0)
        for _ in range(300):
            bs = rng.choice([*GRAPH_BS, 3, 17, 100, 2**31 - 1])
            steps = p.get_steps_for_batch(bs)
            p.on_verify_complete([rng.randint(0, max(steps, 0)) for _ in range(3)], batch_size=bs)
        return p

    def test_every_knob_at_every_extreme(self):
        accepted = 0
        for knob in asp.SLOT_KNOBS[1:]:
            for value in self.EXTREMES:
                for cfg in (
                    {"1": {"candidate_steps": [0, 1, 3, 5, 7], knob: value}},
                    {knob: value, "1": {"candidate_steps": [1, 3]}, "8": {"candidate_steps": [0, 3]}},
                ):
                    with self.subTest(knob=knob, value=value, top_level=knob in cfg):
                        try:
                            clean = normalize_adaptive_config(cfg)
                        except ValueError:
                            continue
                        accepted += 1
                        self.drive(clean)  # no exception in the decision loop
        self.assertGreater(accepted, 20)

    def test_steps_batch_sizes_and_the_gate_at_their_extremes(self):
        for steps in ([0, 64], [64], [2**31 - 1], [-1], [65], [10**400]):
            with self.subTest(steps=steps):
                try:
                    clean = normalize_adaptive_config({"1": {"candidate_steps": steps}})
                except ValueError:
                    self.assertTrue(any(s < 0 or s > asp.MAX_CANDIDATE_STEP for s in steps))
                    continue
                self.drive({**clean, "64": {"candidate_steps": [0]}})
        self.drive({"1": {"candidate_steps": [0, 3]}, str(2**31 - 1): {"candidate_steps": [0]}})
        with self.assertRaisesRegex(ValueError, "out of range"):
            normalize_adaptive_config({str(2**31): {"candidate_steps": [0]}})
        for gate in (0, 2**31 - 1):
            p = make_params()
            p.set_zero_steps_above_bs(gate)
            ungated = make_params().get_steps_for_batch(40)
            self.assertEqual(p.get_steps_for_batch(40), 0 if gate == 0 else ungated)
            self.assertEqual(graph_coverage_gaps(p.required_graph_bs_by_step(gate), startup_capture(p)), {})


def config_at_the_bounds(slots=asp.MAX_ADAPTIVE_SLOTS):
    """*slots* BS slots, each with the longest candidate list and every knob: the most work a config may ask for."""
    steps = list(range(asp.MAX_CANDIDATE_STEP + 1))
    assert len(steps) == asp.MAX_CANDIDATE_STEPS_LEN
    knobs = {"ema_alpha": 0.5, "update_interval": 1, "warmup_batches": 0, "down_hysteresis": 0.0}
    return {str(bs): {"candidate_steps": steps, **knobs} for bs in range(1, slots + 1)}


# Generous, for a loaded shared CPU: the release's decision costs a few microseconds; before the bounds one
# POST with 40,000 slots froze decoding for minutes.
DECISION_BOUND_S = 500e-6
BUILD_BOUND_S = 2.0


class TestBoundsOnWork(unittest.TestCase):
    """Not only every value is bounded, so is the work: the slot count and each candidate list, hence building a
    policy, checking its graph coverage and every per-batch decision."""

    def test_past_the_slot_bound_is_refused_at_it_accepted(self):
        self.assertEqual(len(normalize_adaptive_config(config_at_the_bounds())), asp.MAX_ADAPTIVE_SLOTS)
        with self.assertRaisesRegex(ValueError, f"more than {asp.MAX_ADAPTIVE_SLOTS} BS slots"):
            normalize_adaptive_config(config_at_the_bounds(asp.MAX_ADAPTIVE_SLOTS + 1))
        # The review's 40,000 slots are refused after looking at the first few hundred.
        many = {str(bs): {"candidate_steps": [0, 3]} for bs in range(1, 40_001)}
        with mock.patch.object(asp, "_check_knobs", wraps=asp._check_knobs) as checked, self.assertRaises(ValueError):
            normalize_adaptive_config(many)
        self.assertLessEqual(checked.call_count, asp.MAX_ADAPTIVE_SLOTS)

    def test_a_longer_candidate_list_is_refused(self):
        steps = list(range(asp.MAX_CANDIDATE_STEP + 1))
        normalize_adaptive_config({"1": {"candidate_steps": steps}})
        with self.assertRaisesRegex(ValueError, f"at most {asp.MAX_CANDIDATE_STEPS_LEN} ints"):
            normalize_adaptive_config({"1": {"candidate_steps": [*steps, 0]}})
        with self.assertRaisesRegex(ValueError, r"got \[0, 0, .*\.\.\.$"):
            normalize_adaptive_config({"1": {"candidate_steps": [0] * 100_000}})

    def test_building_a_policy_at_the_bounds_is_linear(self):
        cfg = config_at_the_bounds()
        with mock.patch.object(asp, "AdaptiveStepSlot", wraps=asp.AdaptiveStepSlot) as built:
            params = load_startup(cfg)[0]
        self.assertEqual(built.call_count, asp.MAX_ADAPTIVE_SLOTS)
        # Each slot gets the top-level knobs and its own, not every other slot (the release's O(N^2) merge).
        for call in built.call_args_list:
            self.assertLessEqual(len(call.kwargs["cfg"]), len(asp.SLOT_KNOBS))
        started = time.perf_counter()
        for _ in range(5):
            params = load_startup(cfg)[0]
            params.set_cuda_graph_bs(list(range(1, 513)))
            params.required_graph_bs_by_step(16)
        self.assertLess((time.perf_counter() - started) / 5, BUILD_BOUND_S)

    def test_a_decision_at_the_bounds_stays_cheap(self):
        params = load_startup(config_at_the_bounds())[0]
        params.set_cuda_graph_bs(list(range(1, 513)))
        params.set_zero_steps_above_bs(400, 0)
        rng = random.Random(0)
        batches = [rng.randint(1, 512) for _ in range(2000)]
        started = time.perf_counter()
        for bs in batches:
            params.get_steps_for_batch(bs)
            params.on_verify_complete([rng.randint(0, 64) for _ in range(4)], bs)
        per_decision = (time.perf_counter() - started) / len(batches)
        self.assertLess(per_decision, DECISION_BOUND_S)


class TestOneSchema(unittest.TestCase):
    """The startup file goes through the normalizer that holds the bounds."""

    def test_a_startup_file_with_comments_is_made_canonical(self):
        p, union = load_startup({"_comment": "tuned", "ema_alpha": 0.3, "01": {"candidate_steps": [0, 3], "_why": "x"}})
        self.assertEqual(union, [0, 3])
        config = p.config()  # comments dropped, the BS key canonical, the top-level knob in the slot
        self.assertEqual(sorted(config), ["1"])
        self.assertEqual((config["1"]["candidate_steps"], config["1"]["ema_alpha"]), ([0, 3], 0.3))
        self.assertNotIn("_why", config["1"])

    def test_the_startup_refuses_typos_duplicates_and_unbounded_knobs(self):
        for cfg, pattern in REFUSED_CONFIGS:
            with self.subTest(cfg=cfg), self.assertRaisesRegex(ValueError, pattern):
                load_startup(cfg)

    def test_the_default_config_passes(self):
        self.assertEqual(normalize_adaptive_config(DEFAULT_ADAPTIVE_CONFIG), DEFAULT_ADAPTIVE_CONFIG)


class TestGraphCoverage(unittest.TestCase):
    def setUp(self):
        self.captured = startup_capture(make_params())

    def test_startup_capture_matches_the_default_pruning(self):
        self.assertEqual(self.captured[7], [1, 2, 4])
        self.assertEqual(self.captured[0], [8, 12, 16, 24, 32, 40, 48])
        self.assertEqual(self.captured[3], GRAPH_BS)  # the startup step

    def test_default_slots_with_any_gate_are_covered(self):
        p = make_params()
        for gate in (None, 0, 1, 4, 8, 16, 32, 48, 100):
            with self.subTest(gate=gate):
                self.assertEqual(
                    graph_coverage_gaps(p.required_graph_bs_by_step(gate), self.captured),
                    {},
                )

    def test_deep_steps_at_large_batch_would_run_eager(self):
        p = make_params({"1": {"candidate_steps": [7]}, "8": {"candidate_steps": [5, 7]}})
        gaps = graph_coverage_gaps(p.required_graph_bs_by_step(None), self.captured)
        self.assertEqual(gaps[7], [8, 12, 16, 24, 32, 40, 48])
        self.assertEqual(gaps[5], [8, 12, 16, 24, 32, 40, 48])

    def test_without_padding_sizes_must_match_exactly(self):
        p = make_params({"1": {"candidate_steps": [1, 3]}, "4": {"candidate_steps": [0]}})
        need = p.required_graph_bs_by_step(None)
        self.assertEqual(graph_coverage_gaps(need, self.captured, allow_padding=True), {})
        self.assertEqual(graph_coverage_gaps(need, self.captured, allow_padding=False), {0: [4]})

    def test_graphs_disabled_means_no_gaps(self):
        p = AdaptiveSpeculativeParams(initial_steps=INITIAL_STEPS)
        self.assertEqual(p.required_graph_bs_by_step(0), {})
        self.assertEqual(graph_coverage_gaps({0: [1]}, {0: None}), {})


class TestParseBody(unittest.TestCase):
    def test_gate_is_tri_state(self):
        self.assertEqual(
            parse_runtime_update_body({"zero_steps_above_bs": 16})["zero_steps_above_bs"],
            16,
        )
        cleared = parse_runtime_update_body({"zero_steps_above_bs": None})
        self.assertTrue(cleared["set_zero_steps_above_bs"])
        self.assertIsNone(cleared["zero_steps_above_bs"])
        kept = parse_runtime_update_body({"gate_min_dwell_steps": 4})
        self.assertFalse(kept["set_zero_steps_above_bs"])

    def test_rejects_bad_bodies_before_they_reach_the_scheduler(self):
        bad = [
            ([], "JSON object"),
            ({}, "nothing to change"),
            ({"zero_steps_above_bs": "16"}, r"int in \[0, "),
            ({"zero_steps_above_bs": True}, r"int in \[0, "),
            ({"zero_steps_above_bs": -1}, r"int in \[0, "),
            # Beyond msgpack's ints: refused here, not by an encoder on the way to the scheduler.
            ({"zero_steps_above_bs": 10**30}, r"int in \[0, "),
            ({"expected_generation": 2**70, "zero_steps_above_bs": 1}, "expected_generation"),
            ({"dry_run": "yes", "zero_steps_above_bs": 1}, "dry_run"),
            ({"skip_zero_step_draft_extend": True}, "unknown fields"),
            ({"zero_steps_above_bs": 1, "allow_eager_fallback": True}, "unknown fields"),
            ({"gate_min_dwell_steps": -1}, "gate_min_dwell_steps"),
            ({"gate_min_dwell_steps": 10**6}, "gate_min_dwell_steps"),
            ({"gate_min_dwell_steps": 1.0}, "gate_min_dwell_steps"),
            ({"zero_step_above_bs": 1}, "unknown fields"),
        ]
        for body, pattern in bad:
            with self.subTest(body=body), self.assertRaisesRegex(ValueError, pattern):
                parse_runtime_update_body(body)


if __name__ == "__main__":
    unittest.main()

"""The whole control path in one CPU process, minus ZMQ and the TP broadcast (from the patch sketch, extended).

HTTP handler -> TokenizerControlMixin method -> FanOutCommunicator -> msgpack
(as on the ZMQ socket) -> Scheduler._request_dispatcher -> internal-state
handler -> AdaptiveController -> reply -> msgpack -> communicator -> HTTP.

Needs the heavier import environment (fastapi, uvicorn, transformers, ... and
the GPU-package stubs in cpu_import_stubs/); see the README.
"""

import asyncio
import json
import threading
import types
import unittest
from unittest import mock

from sglang.srt.entrypoints import http_server
from sglang.srt.managers import io_struct
from sglang.srt.managers.communicator import FanOutCommunicator
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components import internal_state
from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
from sglang.srt.speculative.adaptive_runtime_state import (
    AdaptiveController,
    SpecRuntimeState,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from test_adaptive_spec_runtime_policy import make_params

GRAPH_BS = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48]
ADMIN_KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def wire(obj):
    """What crossing a ZMQ socket does to a control message."""
    return io_struct.msgpack_decode(io_struct.msgpack_encode(obj))


def _state(steps):
    return SpecRuntimeState(steps, steps + 1, None, None, object(), None, None, None)


class FakeEagleWorker:
    """The attributes of EAGLEWorkerV2 the handlers touch."""

    def __init__(self, cfg=None):
        steps = 3  # make_params' startup step
        self.speculative_num_steps = steps
        self.speculative_num_draft_tokens = steps + 1
        self.adaptive_controller = AdaptiveController(self, make_params(cfg))
        self.adaptive_controller.register(_state(steps))
        self.adaptive_controller.init_states(cuda_graph_bs=GRAPH_BS)

    def build_adaptive_runtime_state(self, speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
        return _state(speculative_num_steps)

    def apply_runtime_state(self, state):
        self.speculative_num_steps = state.speculative_num_steps
        self.speculative_num_draft_tokens = state.speculative_num_draft_tokens


class RecordingCollector:
    """What the handlers tell SchedulerMetricsCollector (its real methods are checked below)."""

    def __init__(self):
        self.updates = []
        self.policy = []

    def increment_spec_adaptive_policy_update(self, result):
        self.updates.append(result)

    def observe_spec_adaptive_policy(self, zero_steps_above_bs, generation):
        self.policy.append((zero_steps_above_bs, generation))


def fake_scheduler(worker, algorithm="EAGLE3"):
    """A Scheduler with the real dispatcher and internal-state controller."""
    sched = Scheduler.__new__(Scheduler)
    for _ in range(200):  # mock whatever else the dispatcher table references
        try:
            sched.init_request_dispatcher()
            break
        except AttributeError as e:
            name = str(e).split("'")[-2]
            setattr(sched, name, mock.MagicMock(name=name))
    sched.spec_algorithm = SpeculativeAlgorithm.from_string(algorithm)
    sched.draft_worker = worker
    sched.metrics_collector = RecordingCollector()
    sched.internal_state = internal_state.SchedulerInternalStateController(sched, record_step_time=False)
    return sched


class FakeTokenizerManager(TokenizerControlMixin):
    """The mixin's control methods over a communicator whose 'socket' is the
    fake scheduler (one DP group: fan-out 1)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.sent = []
        for name in ("get_spec_adaptive_config", "update_spec_adaptive_config"):
            setattr(self, f"{name}_communicator", FanOutCommunicator(self._send, 1))

    def auto_create_handle_loop(self):
        pass

    def _send(self, obj):
        self.sent.append(obj)
        reply = wire(self.scheduler._request_dispatcher(wire(obj)))
        comm = (
            self.update_spec_adaptive_config_communicator
            if isinstance(reply, io_struct.UpdateSpecAdaptiveConfigReqOutput)
            else self.get_spec_adaptive_config_communicator
        )
        asyncio.get_running_loop().call_soon(comm.handle_recv, reply)


class FakeRequest:
    """Starlette's Request as the handler reads it; *arrives*, an asyncio.Event, holds the body back until set (a
    client whose headers came before its body)."""

    def __init__(self, body, headers=None, arrives=None):
        self._body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.headers = headers if headers is not None else ADMIN
        self.arrives = arrives
        self.read = False

    async def body(self):
        if self.arrives is not None:
            await self.arrives.wait()
        self.read = True
        return self._body


class ControlPathCase(unittest.TestCase):
    def setUp(self):
        parallel = mock.patch.object(
            internal_state, "get_parallel", lambda: types.SimpleNamespace(pp_size=1, tp_size=1)
        )
        parallel.start()
        self.addCleanup(parallel.stop)
        self.serving = types.SimpleNamespace(admin_api_key=ADMIN_KEY, api_key=None)
        serving = mock.patch.object(http_server, "get_serving", lambda: self.serving)
        serving.start()
        self.addCleanup(serving.stop)
        self.worker = FakeEagleWorker()
        self.tm = FakeTokenizerManager(fake_scheduler(self.worker))
        http_server.set_global_state(
            types.SimpleNamespace(tokenizer_manager=self.tm, template_manager=None, scheduler_info={})
        )

    def post(self, body, headers=None):
        resp = asyncio.run(http_server.update_speculative_adaptive(FakeRequest(body, headers)))
        return resp.status_code, json.loads(resp.body)

    def get(self):
        resp = asyncio.run(http_server.get_speculative_adaptive())
        return resp.status_code, json.loads(resp.body)


class TestControlPath(ControlPathCase):
    def test_routes_are_registered(self):
        methods = {
            m for r in http_server.app.routes if getattr(r, "path", None) == "/speculative/adaptive" for m in r.methods
        }
        self.assertEqual(methods, {"GET", "POST"})

    def test_new_messages_are_on_the_msgpack_wire(self):
        names = {c.__name__ for c in io_struct._struct_types}
        for cls in (
            "GetSpecAdaptiveConfigReqInput",
            "GetSpecAdaptiveConfigReqOutput",
            "UpdateSpecAdaptiveConfigReqInput",
            "UpdateSpecAdaptiveConfigReqOutput",
        ):
            self.assertIn(cls, names)

    def test_get_then_gate_then_clear(self):
        status, body = self.get()
        self.assertEqual(status, 200)
        self.assertEqual(body["state"]["captured_steps"], [0, 1, 3, 5, 7])
        self.assertIsNone(body["state"]["zero_steps_above_bs"])

        status, body = self.post({"zero_steps_above_bs": 16, "gate_min_dwell_steps": 8})
        self.assertEqual(status, 200, body)
        self.assertEqual((body["state"]["zero_steps_above_bs"], body["state"]["gate_min_dwell_steps"]), (16, 8))
        self.assertNotIn("skip_zero_step_draft_extend", body["state"])
        self.worker.adaptive_controller.activate_step_by_batch(30)
        self.assertEqual(self.worker.speculative_num_steps, 0)
        self.assertTrue(self.get()[1]["state"]["gate_engaged"])

        status, body = self.post({"zero_steps_above_bs": None})
        self.assertEqual(status, 200, body)
        self.assertIsNone(body["state"]["zero_steps_above_bs"])
        self.assertEqual(body["state"]["generation"], 2)

    def test_post_needs_the_admin_key(self):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_KEY}):
            status, body = self.post({"zero_steps_above_bs": 8}, headers)
            self.assertEqual((status, body["reason"]), (401, "unauthorized"), headers)
        self.serving.admin_api_key = None  # started without --admin-api-key: refused, whatever is sent
        for headers in ({}, ADMIN, {"Authorization": "Bearer anything"}):
            status, body = self.post({"zero_steps_above_bs": 8}, headers)
            self.assertEqual((status, body["reason"]), (403, "admin_api_key_required"), headers)
        self.assertEqual(self.tm.sent, [])
        self.assertEqual(self.get()[0], 200)  # reading stays open (the middleware decides, as for any admin read)

    def test_rejections_map_to_http_status(self):
        status, body = self.post({"zero_steps_above_bs": "16"})
        self.assertEqual(status, 400)
        self.assertEqual(self.tm.sent, [])  # never reached the scheduler
        status, body = self.post(b"{not json")
        self.assertEqual(status, 400)

        self.assertEqual(body["reason"], "invalid_body")

        status, body = self.post({"zero_steps_above_bs": 8, "expected_generation": 5})
        self.assertEqual((status, body["reason"]), (409, "stale_generation"))
        self.assertEqual(self.get()[1]["state"]["generation"], 0)

        # A server whose slots never use 0 steps has no 0-step state to gate with.
        self.worker.adaptive_controller = FakeEagleWorker({"1": {"candidate_steps": [1, 3]}}).adaptive_controller
        status, body = self.post({"zero_steps_above_bs": 8})
        self.assertEqual((status, body["reason"]), (400, "rejected"))
        self.assertIn("0-step runtime state", body["message"])

    def test_a_stale_writer_is_refused(self):
        generation = self.get()[1]["state"]["generation"]
        self.assertEqual(self.post({"zero_steps_above_bs": 8, "expected_generation": generation})[0], 200)
        status, body = self.post({"zero_steps_above_bs": 32, "expected_generation": generation})
        self.assertEqual((status, body["reason"]), (409, "stale_generation"))
        self.assertEqual(self.get()[1]["state"]["zero_steps_above_bs"], 8)

    def test_server_without_adaptive_says_why(self):
        self.worker.adaptive_controller = None
        status, body = self.post({"zero_steps_above_bs": 8})
        self.assertEqual((status, body["reason"]), (501, "not_applicable"))
        self.assertIn("--speculative-adaptive", body["message"])
        self.tm.scheduler.spec_algorithm = SpeculativeAlgorithm.from_string(None)
        status, body = self.get()
        self.assertEqual((status, body["reason"]), (501, "not_applicable"))
        self.assertIn("not enabled", body["message"])

    def test_a_request_travels_the_whole_path(self):
        status, body = self.post({"zero_steps_above_bs": 8})
        self.assertEqual(status, 200, body)
        # Out through the communicator as the wire struct, in through Scheduler._request_dispatcher.
        self.assertEqual([type(m).__name__ for m in self.tm.sent], ["UpdateSpecAdaptiveConfigReqInput"])
        self.assertEqual(body["states"][0]["zero_steps_above_bs"], 8)
        self.assertEqual(self.get()[1]["state"]["zero_steps_above_bs"], 8)

    def test_malformed_bodies_never_reach_the_scheduler(self):
        deep = "[" * 100000 + "]" * 100000
        for raw in (b"{not json", b"", deep.encode(), b'{"zero_steps_above_bs": 1e400}', b"\xff"):
            status, body = self.post(raw)
            self.assertEqual(status, 400, (raw[:20], body))
            self.assertFalse(body["success"])
        for bad in ({"zero_steps_above_bs": 10**30}, {"gate_min_dwell_steps": 10**6}):
            self.assertEqual(self.post(bad)[0], 400)
        self.assertEqual(self.tm.sent, [])

    def test_a_body_past_the_size_bound_is_refused_unread(self):
        bound = http_server.MAX_SPEC_ADAPTIVE_BODY_BYTES
        padded = b'{"zero_steps_above_bs": 8}' + b" " * (bound - 26)
        self.assertEqual(len(padded), bound)
        self.assertEqual(self.post(padded)[0], 200)  # at the bound
        status, body = self.post(padded + b" ")
        self.assertEqual((status, body["reason"]), (400, "invalid_body"))
        self.assertIn("body too large", body["message"])
        # A declared length past the bound is refused before the body is read.
        request = FakeRequest({"zero_steps_above_bs": 8}, {**ADMIN, "Content-Length": str(10**6)})
        resp = asyncio.run(http_server.update_speculative_adaptive(request))
        self.assertEqual(resp.status_code, 400)
        self.assertFalse(request.read)
        self.assertEqual(len(self.tm.sent), 1)

    def test_a_failing_read_is_a_reply_not_a_scheduler_crash(self):
        def broken():
            raise RuntimeError("boom")

        self.worker.adaptive_controller.runtime_config = broken
        with self.assertLogs(internal_state.logger, "ERROR"):
            status, body = self.get()
            self.assertEqual((status, body["reason"]), (500, "failed"))
            self.assertIn("internal error", body["message"])
            status, body = self.post({"zero_steps_above_bs": 4})
        self.assertEqual((status, body["reason"]), (500, "failed"))
        self.assertIn("internal error", body["message"])

    def test_metrics_follow_every_update(self):
        collector = self.tm.scheduler.metrics_collector
        self.post({"zero_steps_above_bs": 16})
        self.post({"zero_steps_above_bs": 8, "expected_generation": 0})
        self.post({"zero_steps_above_bs": None, "dry_run": True})
        self.post({"zero_steps_above_bs": 8}, headers={})  # refused before the scheduler: not counted there
        self.assertEqual(collector.updates, ["applied", "conflict"])
        self.assertEqual(collector.policy[-1], (16, 1))

    def test_the_collector_exports_the_gate(self):
        import inspect

        import prometheus_client
        from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector

        source = inspect.getsource(SchedulerMetricsCollector.__init__)
        for name in (
            "sglang:spec_adaptive_zero_steps_above_bs",
            "sglang:spec_adaptive_policy_generation",
            "sglang:spec_adaptive_policy_updates_total",
        ):
            self.assertIn(name, source)
        registry = prometheus_client.CollectorRegistry()
        collector = SchedulerMetricsCollector.__new__(SchedulerMetricsCollector)
        collector.labels = {"model_name": "m"}
        collector.spec_adaptive_zero_steps_above_bs = prometheus_client.Gauge(
            "sglang:spec_adaptive_zero_steps_above_bs", "", ["model_name"], registry=registry
        )
        collector.spec_adaptive_policy_generation = prometheus_client.Gauge(
            "sglang:spec_adaptive_policy_generation", "", ["model_name"], registry=registry
        )
        collector.spec_adaptive_policy_updates_total = prometheus_client.Counter(
            "sglang:spec_adaptive_policy_updates_total", "", ["model_name", "result"], registry=registry
        )
        collector.observe_spec_adaptive_policy(None, 2)
        collector.increment_spec_adaptive_policy_update("applied")
        labels = {"model_name": "m"}
        self.assertEqual(registry.get_sample_value("sglang:spec_adaptive_zero_steps_above_bs", labels), -1)
        self.assertEqual(registry.get_sample_value("sglang:spec_adaptive_policy_generation", labels), 2)
        self.assertEqual(
            registry.get_sample_value("sglang:spec_adaptive_policy_updates_total", {**labels, "result": "applied"}), 1
        )


def fenced(token):
    return {**ADMIN, http_server.SPEC_ADAPTIVE_FENCE_HEADER: token}


class TestFence(ControlPathCase):
    """The gateway replica that leads the gate sends its lease's token; the scheduler checks it with the update, in
    the order it applies updates: a lower one than an applied update carried (a replica paused past its lease, then
    resumed) is refused, however early its headers came; only an applied update raises the fence."""

    def test_a_lower_token_is_refused_and_changes_nothing(self):
        self.assertEqual(self.post({"zero_steps_above_bs": 16}, fenced("2"))[0], 200)
        with self.assertLogs(http_server.logger, "WARNING") as logs:
            status, body = self.post({"zero_steps_above_bs": 4}, fenced("1"))
        self.assertEqual((status, body["reason"], body["success"]), (409, "fenced", False))
        # The words gateways parse the highest token from (crossover's gateway/engines/fence.py refusal()).
        self.assertIn(
            "fenced: this call carries token 1, but token 2 has been accepted since - a newer lease holder acts "
            "on this GPU set",
            body["message"],
        )
        self.assertIn("token 1", logs.output[0])
        status, body = self.get()
        self.assertEqual((body["state"]["zero_steps_above_bs"], body["state"]["generation"]), (16, 1))
        self.assertEqual(body["fence"], {"highest": 2, "refused": 1})

    def test_an_equal_or_higher_token_or_none_is_accepted_and_raises_the_fence(self):
        for token, gate in (("2", 16), ("2", 8), (None, 6), ("3", 5)):
            headers = ADMIN if token is None else fenced(token)
            status, body = self.post({"zero_steps_above_bs": gate}, headers)
            self.assertEqual(status, 200, body)
        self.assertEqual(body["fence"], {"highest": 3, "refused": 0})
        self.assertEqual(self.post({"zero_steps_above_bs": 4}, fenced("2"))[0], 409)
        self.assertEqual(self.get()[1]["state"]["zero_steps_above_bs"], 5)

    def test_a_stale_body_arriving_after_a_newer_update_is_refused(self):
        """A sends its headers with token 5; B sets gate 6 with token 6; then A's body arrives: refused, gate 6."""

        async def race():
            arrives = asyncio.Event()
            stale = FakeRequest({"zero_steps_above_bs": 5}, fenced("5"), arrives)
            a = asyncio.ensure_future(http_server.update_speculative_adaptive(stale))
            await asyncio.sleep(0)
            self.assertFalse(stale.read)  # A's headers are in, its body is not
            b = await http_server.update_speculative_adaptive(FakeRequest({"zero_steps_above_bs": 6}, fenced("6")))
            arrives.set()
            return b, await a

        b, a = asyncio.run(race())
        self.assertEqual(b.status_code, 200, b.body)
        self.assertEqual((a.status_code, json.loads(a.body)["reason"]), (409, "fenced"))
        state = self.get()[1]
        self.assertEqual((state["state"]["zero_steps_above_bs"], state["state"]["generation"]), (6, 1))
        self.assertEqual(state["fence"], {"highest": 6, "refused": 1})

    def test_a_refused_request_leaves_the_fence_where_it_was(self):
        """One malformed, rejected, stale or dry-run request carrying 10^17 must not lock the real leader out."""
        self.assertEqual(self.post({"zero_steps_above_bs": 8}, fenced("2"))[0], 200)
        huge = fenced(str(10**17))
        for body, expected in (
            (b"{not json", (400, "invalid_body")),
            ({"zero_steps_above_bs": -1}, (400, "invalid_body")),
            ({"gate_min_dwell_steps": 10**6}, (400, "invalid_body")),
            ({"zero_steps_above_bs": 4, "expected_generation": 7}, (409, "stale_generation")),
            ({"zero_steps_above_bs": 4, "dry_run": True}, (200, None)),
        ):
            status, reply = self.post(body, huge)
            self.assertEqual((status, reply.get("reason")), expected, body)
        self.worker.adaptive_controller = FakeEagleWorker({"1": {"candidate_steps": [1, 3]}}).adaptive_controller
        self.worker.adaptive_controller.fence_highest = 2
        status, reply = self.post({"zero_steps_above_bs": 4}, huge)  # no 0-step state: rejected by the scheduler
        self.assertEqual((status, reply["reason"]), (400, "rejected"))
        self.assertEqual(self.get()[1]["fence"]["highest"], 2)
        status, reply = self.post({"gate_min_dwell_steps": 4}, fenced("2"))  # the real leader still leads
        self.assertEqual(status, 200, reply)
        self.assertEqual(reply["fence"], {"highest": 2, "refused": 0})

    def test_a_malformed_token_is_a_bad_request(self):
        for token in ("-1", "two", "1" * 19, "\u0661"):
            status, body = self.post({"zero_steps_above_bs": 4}, fenced(token))
            self.assertEqual((status, body["reason"]), (400, "invalid_fence"), token)
        self.assertEqual(self.tm.sent, [])
        self.assertIsNone(self.get()[1]["fence"]["highest"])

    def test_only_an_admin_moves_the_fence(self):
        status, body = self.post({"zero_steps_above_bs": 4}, {http_server.SPEC_ADAPTIVE_FENCE_HEADER: "99"})
        self.assertEqual((status, body["reason"]), (401, "unauthorized"))
        self.assertEqual(self.post({"zero_steps_above_bs": 4}, fenced("1"))[0], 200)


class TwoRanksCase(unittest.TestCase):
    """Two TP ranks, each a Scheduler with the real dispatcher and handlers, exchanging their votes as
    all_gather_object over the TP CPU group would: an update that does not land alike on both is rolled
    back on both."""

    def setUp(self):
        parallel = mock.patch.object(
            internal_state, "get_parallel", lambda: types.SimpleNamespace(pp_size=1, tp_size=2)
        )
        parallel.start()
        self.addCleanup(parallel.stop)
        self.workers = [FakeEagleWorker(), FakeEagleWorker()]
        self.schedulers = [fake_scheduler(w) for w in self.workers]
        barrier, votes = threading.Barrier(2, timeout=60), [None, None]

        def all_gather(rank):
            def gather(obj):
                votes[rank] = obj
                barrier.wait()
                gathered = list(votes)
                barrier.wait()
                return gathered

            return gather

        for rank, sched in enumerate(self.schedulers):
            sched.internal_state._tp_all_gather = all_gather(rank)

    def broadcast(self, request):
        """Every rank handles the same request at the same point, as after broadcast_pyobj."""
        replies = [None, None]

        def run(rank):
            replies[rank] = wire(self.schedulers[rank]._request_dispatcher(wire(request)))

        threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return replies

    def policies(self):
        return [w.adaptive_controller.policy_digest() for w in self.workers]

    def update(self, **fields):
        return io_struct.UpdateSpecAdaptiveConfigReqInput(**fields)


class TestTwoRanks(TwoRanksCase):
    def test_ranks_that_agree_apply(self):
        replies = self.broadcast(self.update(set_zero_steps_above_bs=True, zero_steps_above_bs=8))
        self.assertTrue(all(r.success for r in replies), replies)
        a, b = self.policies()
        self.assertEqual(a, b)
        self.assertEqual([w.adaptive_controller.generation for w in self.workers], [1, 1])

    def test_a_rank_local_failure_rolls_every_rank_back(self):
        before = self.policies()

        def fail(*_args, **_kwargs):
            raise RuntimeError("injected on rank 1")

        self.workers[1].adaptive_controller.params.set_zero_steps_above_bs = fail
        with self.assertLogs(internal_state.logger, "ERROR"):
            replies = self.broadcast(
                self.update(set_zero_steps_above_bs=True, zero_steps_above_bs=8, gate_min_dwell_steps=4)
            )
        self.assertEqual([(r.success, r.reason) for r in replies], [(False, "failed")] * 2)
        self.assertIn("rolled back", replies[0].message)
        self.assertEqual(self.policies(), before)
        self.assertEqual([w.adaptive_controller.generation for w in self.workers], [0, 0])
        for w in self.workers:
            w.adaptive_controller.activate_step_by_batch(20)
        self.assertEqual([w.speculative_num_steps for w in self.workers], [3, 3])

    def test_a_raise_before_inside_or_after_the_update_on_one_rank_rolls_both_back(self):
        """Whatever raises between the update and the vote, the rank still votes: no rank skips the collective (on
        a real group that would hang the ranks that reached it), and both end where they began."""
        update = self.update(set_zero_steps_above_bs=True, zero_steps_above_bs=8, gate_min_dwell_steps=4, fence=3)
        for where in ("snapshot", "set_zero_steps_above_bs", "policy_digest"):
            with self.subTest(where=where):
                before = self.policies()
                controller = self.workers[1].adaptive_controller
                target = controller.params if where == "set_zero_steps_above_bs" else controller
                calls = []

                def fail(*_args, _calls=calls, _where=where, **_kwargs):
                    _calls.append(_where)
                    raise RuntimeError(f"injected in {_where} on rank 1")

                with mock.patch.object(target, where, fail), self.assertLogs(internal_state.logger, "ERROR"):
                    replies = self.broadcast(update)
                self.assertEqual(calls, [where])
                self.assertEqual([(r.success, r.reason) for r in replies], [(False, "failed")] * 2)
                self.assertEqual(self.policies(), before)
                for w in self.workers:
                    self.assertEqual((w.adaptive_controller.generation, w.adaptive_controller.fence_highest), (0, None))

    def test_a_rank_that_applied_something_else_rolls_every_rank_back(self):
        before = self.policies()
        controller = self.workers[0].adaptive_controller
        with (
            mock.patch.object(controller, "policy_digest", lambda: "something else"),
            self.assertLogs(internal_state.logger, "ERROR"),
        ):
            replies = self.broadcast(self.update(set_zero_steps_above_bs=True, zero_steps_above_bs=8))
        self.assertFalse(any(r.success for r in replies))
        self.assertEqual(self.policies(), before)


if __name__ == "__main__":
    unittest.main()

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The run-time speculation gate on CPU with vLLM's own classes: the schedule's
policy (SpeculationGate), the Scheduler built from a real VllmConfig reading the
rewritten lookup from its next schedule(), EngineCore's utility answering
refusals as results, and the dev route with its admin key, fence and bounds.

Plain unittest (pytest collects it too); needs only a CPU build of vLLM.
"""

import contextlib
import json
import os
import tempfile
import unittest
from types import SimpleNamespace
from unittest import mock

import torch
from vllm.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.spec_decode.dynamic.utils import (
    MAX_FENCE_JUMP,
    MAX_RUNTIME_SCHEDULE_ENTRIES,
    SpeculationGate,
    SpeculationGateRefused,
)
from vllm.v1.structured_output import StructuredOutputManager

# K=3 up to 2 requests, K=0 above: both query lengths (4 and 1) in force.
SCHEDULE = [[1, 2, 3], [3, 16, 0]]
MAX_NUM_SEQS = 16
ADMIN_KEY = "a-test-admin-key"
REFUSAL = "fenced: this call carries token {}, but token {} has been accepted"


def tiny_model_dir() -> str:
    from transformers import LlamaConfig

    path = tempfile.mkdtemp(prefix="spec-gate-model-")
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        architectures=["LlamaForCausalLM"],
    )
    with open(os.path.join(path, "config.json"), "w") as out:
        json.dump(config.to_dict(), out)
    return path


MODEL = tiny_model_dir()


def create_scheduler(schedule: list | None = SCHEDULE, data_parallel_size: int = 1) -> Scheduler:
    scheduler_config = SchedulerConfig(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=4096,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype="float32", seed=0)
    cache_config = CacheConfig(block_size=16, cache_dtype="auto")
    speculative_config = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=3,
        num_speculative_tokens_per_batch_size=schedule,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        speculative_config=speculative_config,
        parallel_config=ParallelConfig(data_parallel_size=data_parallel_size),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=2000,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    cache_config.num_gpu_blocks = 2000
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=16,
    )


def add_requests(scheduler: Scheduler, count: int) -> None:
    for i in range(count):
        scheduler.add_request(
            Request(
                request_id=str(i),
                prompt_token_ids=[i + 1] * 8,
                sampling_params=SamplingParams(max_tokens=64, ignore_eos=True),
                pooling_params=None,
            )
        )


def core(scheduler: Scheduler) -> SimpleNamespace:
    """EngineCore's own utility methods, bound to a namespace holding the
    scheduler (the rest of an EngineCore needs a model executor)."""
    namespace = SimpleNamespace(scheduler=scheduler)
    for name in (
        "get_speculation_gate",
        "update_speculation_gate",
        "_speculation_gate_call",
    ):
        method = getattr(EngineCore, name)
        setattr(namespace, name, method.__get__(namespace))
    return namespace


class TestSpeculationGatePolicy(unittest.TestCase):
    def gate(self, schedule=SCHEDULE) -> SpeculationGate:
        return SpeculationGate(schedule, MAX_NUM_SEQS, 3)

    def test_startup_state_and_the_counts_in_force(self):
        gate = self.gate()
        self.assertEqual(gate.allowed, (0, 3))
        self.assertEqual(gate.lookup[1:], [3, 3] + [0] * 14)
        state = gate.state()
        self.assertEqual(state["generation"], 0)
        self.assertIsNone(state["zero_spec_tokens_above_batch_size"])

    def test_a_gate_zeroes_every_batch_above_it_and_null_lifts_it(self):
        gate = self.gate([[1, 15, 3], [16, 16, 0]])
        lookup = gate.update({"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 16, 0]]})
        self.assertEqual(lookup[1:], [3] + [0] * 15)
        lookup = gate.update({"reset_schedule": True})
        self.assertEqual(lookup[1:], [3] * 15 + [0])
        lookup = gate.update({"zero_spec_tokens_above_batch_size": 4})
        self.assertEqual(lookup[1:], [3] * 4 + [0] * 12)
        lookup = gate.update({"zero_spec_tokens_above_batch_size": 0})
        self.assertEqual(lookup[1:], [0] * 16)
        lookup = gate.update({"zero_spec_tokens_above_batch_size": None})
        self.assertEqual(lookup[1:], [3] * 15 + [0])
        self.assertEqual(gate.generation, 5)

    def test_a_count_the_startup_schedule_never_used_is_refused(self):
        gate = self.gate()
        with self.assertRaises(SpeculationGateRefused) as refused:
            gate.update({"num_speculative_tokens_per_batch_size": [[1, 16, 2]]})
        self.assertEqual(refused.exception.reason, "rejected")
        self.assertIn("[2]", str(refused.exception))
        self.assertEqual(gate.generation, 0)

    def test_a_count_past_its_widest_startup_batch_is_refused(self):
        # SCHEDULE drafts K=3 up to 2 requests: query length 4 has graphs that far.
        gate = self.gate()
        for schedule in ([[1, 4, 3], [5, 16, 0]], [[1, 2, 3]], [[1, 1, 0], [2, 2, 3]]):
            with self.assertRaises(SpeculationGateRefused) as refused:
                gate.update({"num_speculative_tokens_per_batch_size": schedule})
            self.assertEqual(refused.exception.reason, "rejected")
            self.assertIn("K=3 up to 2", str(refused.exception))
        self.assertEqual(gate.generation, 0)
        lookup = gate.update({"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 16, 0]]})
        self.assertEqual(lookup[1:], [3] + [0] * 15)

    def test_a_gate_needs_k0_in_force_at_startup(self):
        gate = self.gate([[1, 16, 3]])
        with self.assertRaises(SpeculationGateRefused) as refused:
            gate.update({"zero_spec_tokens_above_batch_size": 4})
        self.assertIn("K=0", str(refused.exception))
        # A gate at or above max_num_seqs changes no batch: accepted.
        self.assertEqual(
            gate.update({"zero_spec_tokens_above_batch_size": MAX_NUM_SEQS})[1:],
            [3] * 16,
        )

    def test_bounds_and_values(self):
        gate = self.gate()
        too_many = [[i, i, 0] for i in range(1, MAX_RUNTIME_SCHEDULE_ENTRIES + 2)]
        for update in (
            {"num_speculative_tokens_per_batch_size": too_many},
            {"num_speculative_tokens_per_batch_size": []},
            {"num_speculative_tokens_per_batch_size": [[2, 16, 0]]},
            {"num_speculative_tokens_per_batch_size": [[1, 2**40, 0]]},
            {"num_speculative_tokens_per_batch_size": [[1, True, 0]]},
            {"zero_spec_tokens_above_batch_size": -1},
            {"zero_spec_tokens_above_batch_size": 2**31},
            {"zero_spec_tokens_above_batch_size": True},
            {"surprise": 1},
        ):
            with self.subTest(update=update), self.assertRaises(SpeculationGateRefused):
                gate.update(update)
        self.assertEqual(gate.generation, 0)
        self.assertEqual(gate.lookup[1:], [3, 3] + [0] * 14)

    def test_dry_run_and_compare_and_set(self):
        gate = self.gate()
        self.assertIsNone(gate.update({"zero_spec_tokens_above_batch_size": 1, "dry_run": True}))
        self.assertEqual((gate.generation, gate.zero_above), (0, None))
        gate.update({"zero_spec_tokens_above_batch_size": 1, "expected_generation": 0})
        with self.assertRaises(SpeculationGateRefused) as refused:
            gate.update({"zero_spec_tokens_above_batch_size": 2, "expected_generation": 0})
        self.assertEqual(refused.exception.reason, "stale_generation")
        self.assertEqual(gate.zero_above, 1)

    def test_reset_schedule_restores_the_startup_ranges(self):
        gate = self.gate()
        gate.update({"num_speculative_tokens_per_batch_size": [[1, 16, 0]]})
        gate.update({"reset_schedule": True})
        self.assertEqual(gate.lookup[1:], [3, 3] + [0] * 14)


class TestFence(unittest.TestCase):
    def test_a_stale_token_is_refused_in_the_words_gateways_parse(self):
        gate = SpeculationGate(SCHEDULE, MAX_NUM_SEQS, 3)
        gate.update({"zero_spec_tokens_above_batch_size": 1}, fence=7)
        with self.assertRaises(SpeculationGateRefused) as refused:
            gate.update({"zero_spec_tokens_above_batch_size": 2}, fence=6)
        self.assertEqual(refused.exception.reason, "fenced")
        self.assertIn(REFUSAL.format(6, 7), str(refused.exception))
        self.assertEqual(gate.zero_above, 1)
        gate.update({"zero_spec_tokens_above_batch_size": 2}, fence=7)  # same token
        gate.update({"zero_spec_tokens_above_batch_size": 3})  # no token: no cluster
        self.assertEqual(gate.highest_fence, 7)

    def test_a_refused_request_or_a_dry_run_never_raises_the_fence(self):
        gate = SpeculationGate(SCHEDULE, MAX_NUM_SEQS, 3)
        gate.update({"zero_spec_tokens_above_batch_size": 1}, fence=5)
        for update in (
            {"zero_spec_tokens_above_batch_size": -3},
            {"num_speculative_tokens_per_batch_size": [[1, 16, 2]]},
            {"zero_spec_tokens_above_batch_size": 2, "expected_generation": 99},
            {"zero_spec_tokens_above_batch_size": 2, "dry_run": True},
        ):
            with self.subTest(update=update):
                with contextlib.suppress(SpeculationGateRefused):
                    gate.update(update, fence=9)
                self.assertEqual(gate.highest_fence, 5)
        gate.update({"zero_spec_tokens_above_batch_size": 2}, fence=6)
        self.assertEqual(gate.highest_fence, 6)

    def test_a_jump_past_the_bound_is_refused(self):
        gate = SpeculationGate(SCHEDULE, MAX_NUM_SEQS, 3)
        gate.update({"zero_spec_tokens_above_batch_size": 1}, fence=3)
        with self.assertRaises(SpeculationGateRefused) as refused:
            gate.update({"zero_spec_tokens_above_batch_size": 1}, fence=3 + MAX_FENCE_JUMP + 1)
        self.assertEqual(refused.exception.reason, "fence_jump")
        gate.update({"zero_spec_tokens_above_batch_size": 1}, fence=3 + MAX_FENCE_JUMP)


class TestSchedulerFollowsTheGate(unittest.TestCase):
    def decode_step(self, scheduler: Scheduler):
        """One schedule() of requests past their prefill: the K it hands the
        drafter (num_spec_tokens_to_schedule) for this batch size."""
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        self.assertEqual(len(req_ids), len(scheduler.running))
        scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
                sampled_token_ids=[[7] for _ in req_ids],
            ),
        )
        return output

    def test_the_next_schedule_reads_the_rewritten_lookup(self):
        scheduler = create_scheduler([[1, 16, 3], [17, 32, 0]])
        self.assertEqual(scheduler.get_speculation_gate()["allowed_num_speculative_tokens"], [3])
        scheduler = create_scheduler()
        add_requests(scheduler, 2)
        self.assertEqual(self.decode_step(scheduler).num_spec_tokens_to_schedule, 3)
        scheduler.update_speculation_gate({"zero_spec_tokens_above_batch_size": 1})
        self.assertEqual(self.decode_step(scheduler).num_spec_tokens_to_schedule, 0)
        scheduler.update_speculation_gate({"zero_spec_tokens_above_batch_size": 2})
        self.assertEqual(self.decode_step(scheduler).num_spec_tokens_to_schedule, 3)
        scheduler.update_speculation_gate({"zero_spec_tokens_above_batch_size": 0})
        self.assertEqual(self.decode_step(scheduler).num_spec_tokens_to_schedule, 0)
        self.assertIs(scheduler.dynamic_sd_lookup, scheduler.speculation_gate.lookup)

    def test_no_schedule_or_data_parallel_is_not_applicable(self):
        for scheduler, words in (
            (create_scheduler(None), "without num_speculative_tokens_per_batch_size"),
            (create_scheduler(SCHEDULE, data_parallel_size=2), "data parallelism"),
        ):
            with self.subTest(words=words):
                self.assertIsNone(scheduler.dynamic_sd_lookup)
                with self.assertRaises(SpeculationGateRefused) as refused:
                    scheduler.update_speculation_gate({"dry_run": True})
                self.assertEqual(refused.exception.reason, "not_applicable")
                self.assertIn(words, str(refused.exception))


class TestEngineCoreUtility(unittest.TestCase):
    def test_a_refusal_is_a_result_and_an_update_returns_the_state(self):
        engine = core(create_scheduler())
        applied = engine.update_speculation_gate({"zero_spec_tokens_above_batch_size": 1}, 4)
        self.assertTrue(applied["success"])
        self.assertEqual(applied["state"]["highest_fence"], 4)
        refused = engine.update_speculation_gate({"zero_spec_tokens_above_batch_size": 2}, 3)
        self.assertEqual(refused["reason"], "fenced")
        self.assertFalse(refused["success"])
        self.assertEqual(engine.get_speculation_gate()["state"]["generation"], 1)
        no_gate = core(SimpleNamespace()).get_speculation_gate()
        self.assertEqual(no_gate["reason"], "not_applicable")


class TestRoute(unittest.TestCase):
    def setUp(self):
        from fastapi import FastAPI
        from fastapi.testclient import TestClient
        from vllm.entrypoints.serve.dev.sleep.api_router import attach_router

        engine = core(create_scheduler())

        class Client:
            async def get_speculation_gate(self):
                return engine.get_speculation_gate()

            async def update_speculation_gate(self, update, fence=None):
                return engine.update_speculation_gate(update, fence)

        app = FastAPI()
        app.state.engine_client = Client()
        attach_router(app)
        self.http = TestClient(app)
        env = mock.patch.dict(os.environ, {"VLLM_SPECULATION_GATE_ADMIN_KEY": ADMIN_KEY})
        env.start()
        self.addCleanup(env.stop)
        self.auth = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def post(self, body, headers=None, **kwargs):
        return self.http.post(
            "/speculation_gate",
            json=body,
            headers={**self.auth, **(headers or {})},
            **kwargs,
        )

    def test_an_update_and_its_gauge(self):
        from prometheus_client import REGISTRY

        answer = self.post({"zero_spec_tokens_above_batch_size": 1})
        self.assertEqual(answer.status_code, 200, answer.text)
        self.assertEqual(answer.json()["zero_spec_tokens_above_batch_size"], 1)
        self.assertEqual(REGISTRY.get_sample_value("vllm:spec_decode_gate"), 1)
        self.post({"zero_spec_tokens_above_batch_size": None})
        self.assertEqual(REGISTRY.get_sample_value("vllm:spec_decode_gate"), -1)
        got = self.http.get("/speculation_gate", headers=self.auth)
        self.assertEqual(got.json()["generation"], 2)

    def test_the_admin_key(self):
        body = {"zero_spec_tokens_above_batch_size": 1}
        missing = self.http.post("/speculation_gate", json=body)
        self.assertEqual(missing.status_code, 401)
        wrong = self.post(body, {"Authorization": "Bearer nope"})
        self.assertEqual(wrong.status_code, 401)
        self.assertEqual(self.http.get("/speculation_gate").status_code, 401)
        with mock.patch.dict(os.environ, {"VLLM_SPECULATION_GATE_ADMIN_KEY": ""}):
            unset = self.post(body)
        self.assertEqual(unset.status_code, 403)
        self.assertEqual(unset.json()["error"]["type"], "admin_api_key_required")
        self.assertEqual(
            self.http.get("/speculation_gate", headers=self.auth).json()["generation"],
            0,
        )

    def test_the_fence_is_checked_with_the_update(self):
        self.assertEqual(
            self.post({"zero_spec_tokens_above_batch_size": 1}, {"X-Crossover-Fence": "8"}).status_code,
            200,
        )
        stale = self.post({"zero_spec_tokens_above_batch_size": 2}, {"X-Crossover-Fence": "7"})
        self.assertEqual(stale.status_code, 409)
        self.assertEqual(stale.json()["error"]["type"], "fenced")
        self.assertIn(REFUSAL.format(7, 8), stale.json()["error"]["message"])
        bad = self.post({"zero_spec_tokens_above_batch_size": 2}, {"X-Crossover-Fence": "-1"})
        self.assertEqual((bad.status_code, bad.json()["error"]["type"]), (400, "invalid_fence"))
        # A malformed body carrying a huge token raises nothing.
        self.post({"zero_spec_tokens_above_batch_size": "x"}, {"X-Crossover-Fence": "9" * 18})
        self.assertEqual(
            self.http.get("/speculation_gate", headers=self.auth).json()["highest_fence"],
            8,
        )

    def test_bad_bodies(self):
        big = {"num_speculative_tokens_per_batch_size": [[1, 1, 0]] * 10000}
        for body, status, reason in (
            (big, 400, "invalid_body"),
            ({}, 400, "invalid_body"),
            ([1], 400, "invalid_body"),
            ({"zero_spec_tokens_above_batch_size": True}, 400, "invalid_body"),
            ({"unknown": 1}, 400, "invalid_body"),
            ({"num_speculative_tokens_per_batch_size": [[1, 16, 2]]}, 400, "rejected"),
            (
                {"zero_spec_tokens_above_batch_size": 1, "expected_generation": 5},
                409,
                "stale_generation",
            ),
        ):
            with self.subTest(body=str(body)[:60]):
                answer = self.post(body)
                self.assertEqual(answer.status_code, status, answer.text[:300])
                self.assertEqual(answer.json()["error"]["type"], reason)
        deep = self.http.post(
            "/speculation_gate",
            content=b"[" * 30000 + b"]" * 30000,
            headers={**self.auth, "Content-Type": "application/json"},
        )
        self.assertEqual((deep.status_code, deep.json()["error"]["type"]), (400, "invalid_body"))
        not_json = self.http.post(
            "/speculation_gate",
            content=b"{nope",
            headers={**self.auth, "Content-Type": "application/json"},
        )
        self.assertEqual(not_json.status_code, 400)
        self.assertEqual(
            self.http.get("/speculation_gate", headers=self.auth).json()["generation"],
            0,
        )


if __name__ == "__main__":
    unittest.main()

"""Request bodies: streaming with usage per chunk, exact lengths, unique prompts, user fields win."""

from __future__ import annotations

import random

from crossover.loadtest.workload import Workload, make_prompt, request_body


def test_body_streams_with_usage_and_exact_length():
    body = request_body(Workload(model="m", output_len=512, input_len=256), "p")
    assert body["stream"] is True and body["max_tokens"] == 512 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["messages"] == [{"role": "user", "content": "p"}]
    assert request_body(Workload(model="m", output_len=512, input_len=1), "p", output_len=7)["max_tokens"] == 7


def test_eos_can_be_honoured_and_extra_fields_override():
    workload = Workload(model="m", output_len=8, input_len=1, ignore_eos=False, extra_body={"temperature": 0.7})
    body = request_body(workload, "p")
    assert "ignore_eos" not in body and body["temperature"] == 0.7


def test_prompts_have_about_the_asked_words_and_differ_from_the_first_token():
    rng = random.Random(0)
    prompts = [make_prompt(rng, rng.getrandbits(48), 256) for _ in range(50)]
    assert all(len(p.split()) == 255 for p in prompts)
    assert len({p.split()[0] for p in prompts}) == 50  # no shared prefix for a prefix cache to reuse

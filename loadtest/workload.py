"""What each benchmark request asks for: prompt text of about `input_len` tokens and the request body.

There is no tokenizer here (it would tie the tool to one model), so prompts are made of common English
words that are one token in the BPE vocabularies of current models; the real count is read back from each
response's `usage.prompt_tokens`. Every prompt starts with a different nonce so a server's prefix cache
(SGLang's RadixAttention) cannot turn the benchmark into a cache-hit test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# Short, frequent words: one token each (with their leading space) in Llama-3, Kimi/tiktoken-style and
# Qwen vocabularies, so `input_len` words come out close to `input_len` tokens.
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "time",
    "out",
    "up",
    "about",
    "into",
    "than",
    "them",
    "only",
    "new",
    "some",
    "could",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
]


@dataclass(frozen=True)
class Workload:
    """The fixed shape of every request in a run."""

    model: str
    output_len: int
    input_len: int
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)


def make_prompt(rng: random.Random, nonce: int, input_len: int) -> str:
    """About `input_len` tokens, unique from the first token on."""
    words = rng.choices(_WORDS, k=max(0, input_len - 2))
    return f"{nonce} " + " ".join(words)


def request_body(workload: Workload, prompt: str, output_len: int | None = None) -> dict[str, Any]:
    """A streaming chat completion as `bench_serving` sends it, asking for token counts in the stream.

    `ignore_eos` (SGLang and vLLM sampling parameter) makes every request produce exactly `max_tokens`, so
    levels and targets compare like for like; `continuous_usage_stats` adds cumulative usage to every chunk,
    which lets the per-token ITL count the tokens in each chunk (servers that ignore it still send the final
    usage chunk).
    """
    body: dict[str, Any] = {
        "model": workload.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_len or workload.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if workload.ignore_eos:
        body["ignore_eos"] = True
    body.update(workload.extra_body)
    return body

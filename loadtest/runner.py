"""Closed-loop load: at level C, C workers each send streaming chat completions back to back.

Each level runs in three phases, always with C requests in flight:
1. warm-up: the first `warmup_rounds` x C requests to finish are not measured. Each worker's first request
   asks for a random length (1..output_len), so the workers fall out of step. Otherwise (`lockstep`, what
   `bench_serving --max-concurrency` and the stand-in's virtual curves do) C equal requests that start
   together prefill together, decode together and end together forever: a rhythm no real traffic has, that
   flatters prefill batching (by up to ~18% for the k25-plain stand-in at 64 output tokens), and that a
   gateway breaks as soon as it splits a wave between pools - so routed and direct runs compare fairly
   only out of step;
2. the measurement window opens when the last warm-up request finishes and closes when `requests` more
   have finished (default `default_requests(C)`), or after `duration_s` seconds;
3. whatever is still running is cancelled (the server sees a client disconnect and aborts it), so no drain
   tail with fewer than C requests in flight dilutes the window. Tokens those requests received inside the
   window still count towards throughput (see stats.py).

Levels are interleaved across targets (C=1 on every target, then C=2, ...), and each level is measured in
`passes` passes with the targets alternating and their order turned every other pass (A B B A A B ...), each
pass a warm-up and a window of its share of the level: a machine that slows down during the run shifts every
target alike, and one whose speed drifts within a level spreads each target's sub-windows (a wider interval)
instead of handing one target a lead. A pass that
`on_pass_done` rejects (a stand-in fell behind during it) is measured again, up to MAX_RERUNS_PER_LEVEL times
per level, so a few slow seconds cost that pass, not the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence

import certifi
import httpx

from crossover.loadtest.client import RequestResult, run_request
from crossover.loadtest.config import MAX_RERUNS_PER_LEVEL
from crossover.loadtest.models import Level
from crossover.loadtest.plan import LoadSettings, Target
from crossover.loadtest.stats import Window, summarize_passes
from crossover.loadtest.workload import Workload, make_prompt, request_body

# Below uvicorn's 5 s idle timeout, so a pooled connection is never reused just as the server closes it.
DEFAULT_KEEPALIVE_EXPIRY_S = 2.0
PROBE_OUTPUT_LEN = 8


ProgressHook = Callable[[RequestResult], None]


def tls_context() -> ssl.SSLContext:
    """Built once per level and shared: loading the CA bundle costs ~16 ms of CPU per client."""
    return ssl.create_default_context(cafile=certifi.where())


def make_client(load: LoadSettings, tls: ssl.SSLContext) -> httpx.AsyncClient:
    """A worker's own client: one kept-alive connection, explicit timeouts, no retries (a failure is a
    measurement). One client per worker rather than one shared pool: httpcore's pool scans every
    connection on each request and response, which at C=256 cost more CPU than the streams themselves.
    """
    return httpx.AsyncClient(
        verify=tls,
        limits=httpx.Limits(
            max_connections=1, max_keepalive_connections=1, keepalive_expiry=DEFAULT_KEEPALIVE_EXPIRY_S
        ),
        timeout=httpx.Timeout(
            connect=load.connect_timeout_s,
            read=load.read_timeout_s,
            write=load.connect_timeout_s,
            pool=load.request_timeout_s,
        ),
    )


async def run_level(
    target: Target,
    concurrency: int,
    workload: Workload,
    load: LoadSettings,
    on_result: ProgressHook | None = None,
) -> Level:
    """Drive one target at one concurrency in one window; returns its `levels[]` entry. `on_result` sees every
    finish."""
    window = await measure(target, concurrency, workload, load, on_result)
    return summarize_passes(target.name, concurrency, [window])


async def measure(
    target: Target,
    concurrency: int,
    workload: Workload,
    load: LoadSettings,
    on_result: ProgressHook | None = None,
) -> Window:
    """One warm-up and one measurement window of one target at one concurrency (`load`'s amount)."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    warmup = load.warmup_rounds * concurrency
    planned = load.planned(concurrency)
    headers = {"Content-Type": "application/json", **load.headers}
    started: list[RequestResult] = []
    measured: list[RequestResult] = []
    finished = 0
    window: list[float] = []  # [t0] once the warm-up is over, [t0, t1] once measured
    opened, closed = asyncio.Event(), asyncio.Event()

    def open_window() -> None:
        window.append(time.perf_counter())
        opened.set()

    def close() -> None:
        if not opened.is_set():
            open_window()  # closing early (a crashed worker): an empty window rather than a hang
        if not closed.is_set():
            window.append(time.perf_counter())
            closed.set()

    tls = tls_context()

    async def worker(index: int) -> None:
        nonlocal finished
        # Seeded per worker, not shared: every target at a level gets the same prompts and warm-up lengths
        # from each worker whatever the scheduling order, so their runs differ only by the server.
        rng = random.Random(f"{load.seed}/{concurrency}/{index}")
        desync = warmup > 0 and not load.lockstep
        async with make_client(load, tls) as client:
            while not closed.is_set():
                prompt = make_prompt(rng, rng.getrandbits(48), workload.input_len)
                length = rng.randint(1, workload.output_len) if desync else None
                desync = False
                body = json.dumps(request_body(workload, prompt, length)).encode()
                result = RequestResult(start=time.perf_counter())
                started.append(result)
                await run_request(client, target.chat_url, body, headers, load.request_timeout_s, result)
                if closed.is_set():
                    return  # ended after the window closed: not measured
                finished += 1
                if finished <= warmup:
                    if finished == warmup:
                        open_window()
                else:
                    measured.append(result)
                    if planned is not None and len(measured) == planned:
                        close()
                if on_result is not None:
                    on_result(result)

    async def guarded(index: int) -> None:
        try:
            await worker(index)
        except Exception:
            close()  # a crashed worker (a bug, a broken hook) ends the level instead of leaving it waiting
            raise

    if warmup == 0:
        open_window()
    workers = [asyncio.create_task(guarded(i)) for i in range(concurrency)]
    try:
        await opened.wait()
        if planned is None:
            # The measurement itself: a fixed window of wall time (ended early only by a crashed worker).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closed.wait(), load.duration_s)
            close()
        await closed.wait()
    finally:
        for task in workers:
            task.cancel()
        outcomes = await asyncio.gather(*workers, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return Window(started, measured, window[0], window[1])


async def probe(target: Target, workload: Workload, load: LoadSettings) -> RequestResult:
    """One short request: proves the target answers streams with usage before a sweep relies on it."""
    short = Workload(
        model=workload.model,
        output_len=min(workload.output_len, PROBE_OUTPUT_LEN),
        input_len=min(workload.input_len, 16),
        ignore_eos=workload.ignore_eos,
        extra_body=workload.extra_body,
    )
    prompt = make_prompt(random.Random(load.seed), 0, short.input_len)
    async with make_client(load, tls_context()) as client:
        return await run_request(
            client,
            target.chat_url,
            json.dumps(request_body(short, prompt)).encode(),
            {"Content-Type": "application/json", **load.headers},
            load.request_timeout_s,
        )


# on_pass_done(C, pass_index, may_rerun) -> keep the pass
PassCheck = Callable[[int, int, bool], Awaitable[bool]]


async def run_sweep(
    targets: Sequence[Target],
    concurrencies: Sequence[int],
    workload: Workload,
    load: LoadSettings,
    on_level_start: Callable[[Target, int, int | None], ProgressHook | None] | None = None,
    on_level_done: Callable[[Level], Awaitable[None]] | None = None,
    on_level_begin: Callable[[Target, int], Awaitable[Callable[[Window], Awaitable[None]] | None]] | None = None,
    on_pass_done: PassCheck | None = None,
) -> list[Level]:
    """Every target at every level, interleaved by level and alternating pass by pass; returns the `levels[]`
    entries in run order.

    `on_level_start(target, C, requests)` - called once per pass, `requests` counting the pass's warm-up and
    measured requests, None for a timed window - may return a per-request hook (for a progress display).
    `on_level_begin(target, C)` is awaited right before a pass's first request of that target and may return a
    coroutine function awaited with the pass's window right after its last (bench reads a stand-in's clock at
    both, so its lag check covers the whole pass); `on_pass_done(C, pass_index, may_rerun)` after every target
    ran the pass: False measures the pass again, if `may_rerun`.
    `on_level_done(level)` is awaited for each target once its level is summarized, before the next level.
    """
    levels: list[Level] = []
    for concurrency in concurrencies:
        share = load.one_pass(concurrency)
        planned = share.planned(concurrency)
        total = None if planned is None else planned + share.warmup_rounds * concurrency
        windows: dict[str, list[Window]] = {target.name: [] for target in targets}
        kept = reruns = 0
        while kept < load.passes:
            measured: dict[str, Window] = {}
            # A B, then B A: going first or second in a pass (after the other target's load, or a level's end)
            # favours no target, and drift that is linear over the level cancels.
            for target in targets if kept % 2 == 0 else reversed(targets):
                hook = on_level_start(target, concurrency, total) if on_level_start else None
                ended = await on_level_begin(target, concurrency) if on_level_begin is not None else None
                measured[target.name] = await measure(target, concurrency, workload, share, hook)
                if ended is not None:
                    await ended(measured[target.name])
            may_rerun = reruns < MAX_RERUNS_PER_LEVEL
            if on_pass_done is not None and not await on_pass_done(concurrency, kept, may_rerun) and may_rerun:
                reruns += 1
                continue
            for name, window in measured.items():
                windows[name].append(window)
            kept += 1
        for target in targets:
            level = summarize_passes(target.name, concurrency, windows[target.name])
            levels.append(level)
            if on_level_done is not None:
                await on_level_done(level)
    return levels

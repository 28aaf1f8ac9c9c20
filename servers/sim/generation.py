"""`/v1/chat/completions` and `/v1/completions`: validate, queue in the engine, stream or answer.

Failure modes, as SGLang shows them to a client:
  bad body (type, JSON, fields, length)    -> 400 (413 when too large) with a top-level error body
  starting / memory released               -> 503 with a top-level error body
  waiting queue full, not streaming        -> 503 {"object": "error", "message": "The request queue is full.", ...}
  waiting queue full, streaming            -> 200, `data: {"error": {... "code": 503}}`, `data: [DONE]`
  aborted by /pause_generation (abort)     -> finish_reason "abort"
  held while paused, then the queue is full or memory is still released at /continue_generation
                                           -> 503 (not streaming) or an error event (streaming), as above
  client disconnect                        -> the request is aborted inside the engine at once
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from crossover.servers.sim.engine import QueueFull, Sequence, State
from crossover.servers.sim.live import LiveEngine
from crossover.servers.sim.metrics import SimMetrics
from crossover.servers.sim.openai_format import (
    DONE,
    SGLANG_ERRORS,
    BadRequest,
    Endpoint,
    ErrorShape,
    Generation,
    StreamEncoder,
    parse_generation,
    response_body,
)
from crossover.servers.sim.profile import Profile

MAX_BODY_BYTES = 16 * 1024 * 1024


class TooLarge(Exception):
    pass


def json_response(content: Any, status: int = 200) -> Response:
    # Compact, as SGLang's orjson writes it.
    body = json.dumps(content, separators=(",", ":")).encode()
    return Response(body, status_code=status, media_type="application/json")


def register(
    app: FastAPI,
    live: LiveEngine,
    metrics: SimMetrics,
    profile: Profile,
    errors: ErrorShape = SGLANG_ERRORS,
    *,
    refuse_released: bool = True,
) -> None:
    """`errors`: the engine's error shapes; `refuse_released`: SGLang refuses (503) while its memory is released,
    vLLM holds a request that arrives while it sleeps until /wake_up."""

    async def chat(request: Request) -> Response:
        return await _generate("chat", request)

    async def completions(request: Request) -> Response:
        return await _generate("completion", request)

    async def _generate(endpoint: Endpoint, request: Request) -> Response:
        arrived = asyncio.get_running_loop().time()
        try:
            gen = parse_generation(
                endpoint,
                await read_json(request),
                context_length=profile.limits.context_length,
                default_model=profile.model_name,
            )
            if not live.engine.fits(gen.prompt_tokens, gen.max_tokens):
                raise BadRequest(
                    f"The request needs {gen.prompt_tokens + gen.max_tokens} KV cache tokens; the "
                    f"server's pool holds {profile.limits.max_total_num_tokens}."
                )
        except BadRequest as exc:
            return json_response(errors.body(str(exc)), 400)
        except TooLarge as exc:
            return json_response(errors.body(str(exc), status=413, err_type="RequestEntityTooLarge"), 413)
        refusal = live.refusal(released=refuse_released)
        if refusal is not None:
            return json_response(errors.body(refusal, status=503, err_type="ServiceUnavailable"), 503)
        rid = uuid.uuid4().hex  # SGLang's request id, which it also uses as the response id
        created = int(time.time())
        if gen.stream:
            return StreamingResponse(
                _stream(gen, StreamEncoder(gen, rid, created), arrived), media_type="text/event-stream"
            )
        seq = Sequence(gen.prompt_tokens, gen.max_tokens)
        try:
            live.submit(seq)
        except QueueFull as exc:
            return json_response(
                errors.body(errors.queue_full(str(exc)), status=503, err_type=errors.busy_body_type), 503
            )
        if not await _wait(request, seq):
            return Response(status_code=499)  # nobody is listening any more
        if seq.error is not None:
            metrics.aborted.inc()
            return json_response(errors.body(seq.error, status=503, err_type=errors.busy_body_type), 503)
        if seq.first_token_at is not None:
            _observe_first_token(seq, first_token_s=(seq.first_token_at - seq.arrival) / live.time_scale)
        if seq.state is State.FINISHED:
            metrics.observe_finished(
                prompt_tokens=gen.prompt_tokens,
                completion_tokens=seq.generated,
                e2e_s=asyncio.get_running_loop().time() - arrived,
            )
        else:
            metrics.aborted.inc()
        reason = gen.finish_reason if seq.state is State.FINISHED else "abort"
        return json_response(response_body(gen, rid, created, seq.generated, reason))

    async def _stream(gen: Generation, enc: StreamEncoder, arrived: float) -> AsyncIterator[bytes]:
        # The request enters the engine only once the body iterates, so a client gone before that leaves
        # nothing behind; from then on `finally` owns its cleanup.
        seq = Sequence(gen.prompt_tokens, gen.max_tokens)
        try:
            live.submit(seq)
        except QueueFull as exc:  # SGLang answers 200 and reports this inside the stream
            yield errors.stream(errors.queue_full(str(exc)), status=503, err_type=errors.busy_type)
            yield DONE
            return
        loop = asyncio.get_running_loop()
        sent, last = 0, arrived
        try:
            async for n in live.stream(seq):
                now = loop.time()
                if sent == 0:
                    _observe_first_token(seq, first_token_s=now - arrived)
                    chunk = enc.first(n)
                else:
                    metrics.observe_chunk(now - last, n)
                    chunk = enc.tokens(sent, n)
                sent, last = sent + n, now
                yield chunk
            if seq.error is not None:  # SGLang reports a failure after HTTP 200 inside the stream
                metrics.aborted.inc()
                yield errors.stream(seq.error, status=503, err_type=errors.busy_type)
                yield DONE
                return
            if sent == 0 and seq.state is State.FINISHED:  # max_tokens = 0
                _observe_first_token(seq, first_token_s=loop.time() - arrived)
                yield enc.first(0)
            if seq.state is State.FINISHED:
                metrics.observe_finished(
                    prompt_tokens=gen.prompt_tokens, completion_tokens=sent, e2e_s=loop.time() - arrived
                )
                yield enc.finish(gen.finish_reason)
            else:
                metrics.aborted.inc()
                yield enc.finish("abort")
            if gen.include_usage:
                yield enc.usage(sent)
            yield DONE
        finally:
            # A client that goes away cancels this generator at its current await (Starlette's
            # StreamingResponse), so the engine must drop the request here.
            if not seq.done:
                live.abort(seq)
                metrics.aborted.inc()

    async def _wait(request: Request, seq: Sequence) -> bool:
        """Until `seq` ends (True) or the client disconnects (False, and the request is aborted)."""
        finished = asyncio.ensure_future(live.finished(seq))
        gone = asyncio.ensure_future(_disconnected(request))
        client_gone = True
        try:
            await asyncio.wait((finished, gone), return_when=asyncio.FIRST_COMPLETED)
            client_gone = not finished.done()
        finally:
            finished.cancel()
            gone.cancel()
            if not seq.done:
                live.abort(seq)
                metrics.aborted.inc()
        return not client_gone

    def _observe_first_token(seq: Sequence, *, first_token_s: float) -> None:
        metrics.ttft.observe(first_token_s)
        if seq.admitted_at is not None:
            metrics.queue_time.observe(max(0.0, seq.admitted_at - seq.arrival) / live.time_scale)

    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])


async def read_json(request: Request, *, require_json_type: bool = True) -> Any:
    """The body as JSON (None when empty and allowed). SGLang's /v1 routes insist on the content type."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if require_json_type and media_type != "application/json":
        raise BadRequest("Unsupported Media Type: Only 'application/json' is allowed")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise TooLarge(f"Request body too large: more than {MAX_BODY_BYTES} bytes.")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise TooLarge(f"Request body too large: more than {MAX_BODY_BYTES} bytes.")
    if not body.strip() and not require_json_type:
        return None
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass

"""Server-sent events as the gateway needs them: where events end, the first event, error events, usage.

SGLang reports errors after a stream has started with HTTP 200 and an event
`data: {"error": {"message": ..., "code": 503, ...}}` then `data: [DONE]` - the gateway speaks the same way
when it has to cut a stream (`error_event`), so a client sees one format whoever failed.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from crossover.gateway.errors import error_body

EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
DONE = b"data: [DONE]\n\n"
# What every error event holds, and generated text cannot (its quotes are escaped): a test cheap enough for
# every chunk of a stream. Looked for with `data.find(ERROR_MARK) >= 0`, not `in`: CPython's bytes `in` first
# tries its operand as an integer (`65 in b"A"`), formatting and dropping a TypeError for every bytes operand,
# which made it twice the cost of `find` (gdb on a streaming gateway: the only error raised per piece).
ERROR_MARK = b'{"error"'


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    message: str
    # The HTTP status the error stands for, when the event says (SGLang: `"code": 503` for a full queue).
    status: int | None


def split_events(data: bytes) -> tuple[bytes, bytes]:
    """(the complete SSE events at the start of `data`, the unfinished event after them)."""
    if data.endswith(EVENT_ENDS):
        return data, b""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
    return data[:end], data[end:]


async def first_event(chunks: AsyncIterator[bytes]) -> bytes:
    """Read until the first SSE event is complete (or the stream ends)."""
    head = b""
    async for chunk in chunks:
        head += chunk
        if any(end in head for end in EVENT_ENDS):
            break
    return head


def error_in(head: bytes) -> ErrorEvent | None:
    """The error a stream (or an SSE body) opens with, if it opens with one."""
    end = head.find(b"\n\n")
    if end < 0:
        end = head.find(b"\r\n\r\n")
    event = (head if end < 0 else head[:end]).strip()
    # Every stream's first event passes here: most carry no error, and need no JSON parse to say so.
    if not event.startswith(b"data:") or b'"error"' not in event:
        return None
    data = event[5:].strip()
    if not data.startswith(b"{"):
        return None
    try:
        payload = json.loads(data)
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    if not error:
        return None
    if not isinstance(error, dict):
        return ErrorEvent(str(error), None)
    code = error.get("code")
    status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599 else None
    return ErrorEvent(str(error.get("message", error)), status)


def error_event(message: str, type: str = "api_error", code: str | None = None) -> bytes:
    """The end of a stream that failed after its first byte: an error event, then [DONE]."""
    event = json.dumps(error_body(message, type, None, code))
    return f"data: {event}\n\n".encode() + DONE


def usage_tokens(data: bytes) -> int:
    """`usage.completion_tokens` of a JSON body, or of the last event carrying usage in a stream's tail; 0 if
    none. Found, not parsed: a long answer's JSON costs more to parse than the rest of its proxying, and the
    key's quotes cannot occur unescaped inside generated text."""
    at = data.rfind(b'"completion_tokens"')
    if at < 0:
        return 0
    match = _COMPLETION_TOKENS.match(data, at)
    return int(match[1]) if match else 0


def usage_prompt_tokens(data: bytes) -> int:
    """`usage.prompt_tokens`, found as `usage_tokens` finds its count; 0 if none."""
    at = data.rfind(b'"prompt_tokens"')
    if at < 0:
        return 0
    match = _PROMPT_TOKENS.match(data, at)
    return int(match[1]) if match else 0


# At most 18 digits: a count longer than that is no count (and int() refuses one of over 4,300 digits), so it
# counts as none rather than raising on every such answer.
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,18})(?!\d)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,18})(?!\d)')

"""Request ids (gateway/wire/headers.py): a client's sane id is kept; fresh ones never repeat, in a fork either."""

from __future__ import annotations

import os
import re

from crossover.gateway.wire.headers import MAX_REQUEST_ID_BYTES, fresh_id, request_id


def test_a_sane_client_id_is_kept_and_anything_else_gets_a_fresh_one():
    assert request_id([(b"x-request-id", b"client-7")]) == b"client-7"
    for bad in (b"", b"x" * (MAX_REQUEST_ID_BYTES + 1), b"caf\xc3\xa9", b"a\x00b"):
        assert re.fullmatch(rb"[0-9a-f]{32}", request_id([(b"x-request-id", bad)]))


def test_fresh_ids_do_not_repeat_within_a_process_or_across_a_fork():
    ids = {fresh_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child reports its next id and leaves at once
        os.write(write, fresh_id())
        os._exit(0)
    os.close(write)
    child_id = os.read(read, 64)
    os.close(read)
    os.waitpid(child, 0)
    parent_id = fresh_id()
    assert child_id not in ids and child_id[:16] != parent_id[:16]

"""The agent's bearer token: what it may be, and how it is read from a file.

    token = read_token_file(Path("/etc/crossover/agent-token"))   # TokenError, one line, if the file is unfit
    problem = token_problem(token)                                  # None, or why no client could send it

A token file is checked the way ssh checks a private key: a regular file (a FIFO would hold the agent's start
forever, a directory or a device is a mistake) that nobody but its owner may read or write. The token travels in
an HTTP header, which carries ASCII: a token with any other character starts an agent nobody can authenticate to.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# A token is tens of bytes; a file far larger than that is not one (and is not read whole).
MAX_TOKEN_FILE_BYTES = 4096


class TokenError(ValueError):
    """A token file or token the agent refuses to start with (the message is one line, the token never in it)."""


def token_problem(token: str) -> str | None:
    """Why `token` cannot work as the agent's bearer token, or None."""
    # A blank token would be accepted and then match nothing a client can send.
    if not token.strip():
        return "the agent never runs open: its token is empty or blank"
    for position, char in enumerate(token, 1):
        if not char.isascii():
            return f"the agent's token has a non-ASCII character (at position {position}): HTTP headers carry ASCII"
        if char.isspace() or not char.isprintable():
            return (
                f"the agent's token has a space or a control character (at position {position}): it must be "
                "printable ASCII with no spaces (it travels in a header)"
            )
    return None


def _unfit(path: Path, info: os.stat_result) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return f"the token file {path} is not a regular file ({_kind(info.st_mode)})"
    if info.st_mode & 0o077:
        mode = stat.S_IMODE(info.st_mode)
        return f"the token file {path} is open to group or others (mode {mode:04o}): run `chmod 600 {path}`"
    return None


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a plain file"


def read_token_file(path: Path) -> str:
    """The token in `path`, stripped of surrounding whitespace (its problems are `token_problem`'s to tell)."""
    try:
        # stat before open: opening a FIFO for reading waits for a writer, opening a device may do something.
        before = os.stat(path)
    except OSError as exc:
        raise TokenError(f"cannot read the token file {path}: {exc.strerror}") from None
    if (unfit := _unfit(path, before)) is not None:
        raise TokenError(unfit)
    try:
        # O_NONBLOCK: should the path have become a FIFO since the stat, the open still returns at once.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise TokenError(f"cannot read the token file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        # What was opened is what counts: checked again, then read.
        if (unfit := _unfit(path, os.fstat(file.fileno()))) is not None:
            raise TokenError(unfit)
        raw = file.read(MAX_TOKEN_FILE_BYTES + 1)
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise TokenError(f"the token file {path} is larger than {MAX_TOKEN_FILE_BYTES} bytes: not a token")
    if not raw.isascii():
        raise TokenError(f"the token file {path} holds non-ASCII bytes: HTTP headers carry ASCII")
    return raw.decode("ascii").strip()

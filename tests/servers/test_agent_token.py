"""The agent's token (servers/agent_token.py): a token file that is not a regular file (a FIFO must not hold the
start), that group or others may read or write, or that holds non-ASCII, and a token from the environment or
--token with a non-ASCII or control character - each stops the agent at start with one line saying why, exit 2."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from crossover.servers.agent_token import TokenError, read_token_file, token_problem
from crossover.servers.process import free_port
from tests.conftest import crossover_argv
from tests.servers.conftest import TOKEN

# Far beyond the agent's start-up: a start that blocks on a FIFO is cut here (and fails) instead of hanging.
START_TIMEOUT_S = 60


def token_file(tmp_path: Path, content: bytes | str = TOKEN, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)
    return path


def run_agent(standin_profile, *extra: str, env_token: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CROSSOVER_AGENT_TOKEN"}
    if env_token is not None:
        env["CROSSOVER_AGENT_TOKEN"] = env_token
    argv = crossover_argv("servers", "agent", str(standin_profile("standin-time-shared")), "--port", str(free_port()))
    return subprocess.run(
        [*argv, *extra], capture_output=True, text=True, timeout=START_TIMEOUT_S, env=env, check=False
    )


def refused_at_start(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert TOKEN not in result.stderr, "the token is never printed"


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640, 0o602])
def test_a_token_file_others_may_read_or_write_stops_the_agent(standin_profile, tmp_path, mode):
    path = token_file(tmp_path, TOKEN + "\n", mode)
    result = run_agent(standin_profile, "--token-file", str(path))
    refused_at_start(result, f"(mode {mode:04o}): run `chmod 600 {path}`")


def test_a_fifo_as_the_token_file_stops_the_agent_at_once(standin_profile, tmp_path):
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)  # nobody writes to it: an agent that opened it to read would wait forever
    result = run_agent(standin_profile, "--token-file", str(fifo))
    refused_at_start(result, f"the token file {fifo} is not a regular file (a FIFO)")


def test_a_directory_as_the_token_file_stops_the_agent(standin_profile, tmp_path):
    result = run_agent(standin_profile, "--token-file", str(tmp_path))
    refused_at_start(result, "is not a regular file (a directory)")


@pytest.mark.parametrize("content", ["sécret-token\n".encode(), b"\xff\xfe token", "токен".encode()])
def test_a_token_file_with_non_ascii_stops_the_agent(standin_profile, tmp_path, content):
    result = run_agent(standin_profile, "--token-file", str(token_file(tmp_path, content)))
    refused_at_start(result, "holds non-ASCII bytes")


@pytest.mark.parametrize(("where", "token"), [("env", "sécret"), ("argv", "sécret"), ("env", "a\x1bb")])
def test_a_token_from_the_environment_or_argv_with_non_ascii_stops_the_agent(standin_profile, where, token):
    if where == "env":
        result = run_agent(standin_profile, env_token=token)
        source = "$CROSSOVER_AGENT_TOKEN"
    else:
        result = run_agent(standin_profile, "--token", token)
        source = "--token"
    assert result.returncode == 2, result.stderr
    error = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and f"error: {source}: the agent's token has a" in error[0], result.stderr
    assert ("non-ASCII" if not token.isascii() else "control character") in error[0]


def test_a_token_file_only_its_owner_may_read_gives_its_token(tmp_path):
    assert read_token_file(token_file(tmp_path, f"  {TOKEN}\n", 0o600)) == TOKEN
    assert read_token_file(token_file(tmp_path, TOKEN, 0o400)) == TOKEN
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "token")  # as a mounted secret is: the file it names is what is checked
    assert read_token_file(link) == TOKEN


def test_what_a_token_may_be(tmp_path):
    assert token_problem(TOKEN) is None
    assert "empty or blank" in (token_problem(" \t") or "")
    assert "non-ASCII character (at position 2)" in (token_problem("aé") or "")
    assert "control character (at position 3)" in (token_problem("ab\x00") or "")
    assert "space" in (token_problem("a b") or "")
    with pytest.raises(TokenError, match="larger than 4096 bytes"):
        read_token_file(token_file(tmp_path, b"x" * 5000))

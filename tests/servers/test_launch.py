"""The admin key in a launch: `argv` (printed, logged, recorded) shows its file, `run_argv()` reads the key then.
The argv SGLang's parser accepts is test_sglang_parser.py's concern."""

from __future__ import annotations

import os

import pytest

from crossover.servers.launch import LaunchError, admin_key_placeholder, launch_command
from crossover.servers.profile import load_profile, parse_profile
from tests.servers.conftest import SHIPPED


def kimi_with_key_file(path) -> tuple:
    text = (SHIPPED / "kimi-k25-in-engine.toml").read_text().replace("/etc/crossover/sglang-admin.key", str(path))
    profile = parse_profile(text, name="kimi", source="test")
    return profile, profile.servers[0]


def test_the_key_is_read_from_its_file_at_launch_and_shown_as_the_file(tmp_path):
    key_file = tmp_path / "admin.key"
    profile, server = kimi_with_key_file(key_file)
    command = launch_command(profile, server)  # no file yet: a plan needs none
    shown = admin_key_placeholder(str(key_file))
    assert command.argv[command.argv.index("--admin-api-key") + 1] == shown
    key_file.write_text("first-key\n")
    run = command.run_argv()
    assert run[run.index("--admin-api-key") + 1] == "first-key"
    assert [a for a in run if a != "first-key"] == [a for a in command.argv if a != shown]
    key_file.write_text("rotated-key\n")  # read at each launch, not when the profile was loaded
    assert "rotated-key" in command.run_argv()
    assert "rotated-key" not in command.argv and shown in command.as_json()["argv"]


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot be read: No such file or directory"), ("", "must hold one key"), ("a b\n", "must hold one key")],
)
def test_a_missing_or_malformed_key_file_is_one_line_naming_it(tmp_path, content, message):
    key_file = tmp_path / "admin.key"
    if content is not None:
        key_file.write_text(content)
    profile, server = kimi_with_key_file(key_file)
    with pytest.raises(LaunchError, match=message) as caught:
        launch_command(profile, server).run_argv()
    assert str(key_file) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_key_file_is_refused(tmp_path):
    key_file = tmp_path / "admin.key"
    key_file.write_text("k\n")
    key_file.chmod(0)
    profile, server = kimi_with_key_file(key_file)
    with pytest.raises(LaunchError, match="cannot be read: Permission denied"):
        launch_command(profile, server).run_argv()


def test_a_standin_reads_its_key_file_itself():
    profile = load_profile("standin-in-engine")
    for server in profile.servers:
        command = launch_command(profile, server)
        assert command.argv[command.argv.index("--admin-api-key-file") + 1] == server.admin_api_key_file
        assert command.run_argv() == command.argv  # nothing to put in; the file is checked readable

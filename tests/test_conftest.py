"""The suite's shared hooks: a run that skipped tests says in its last lines what they left unchecked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_that_skipped_ends_with_one_line_naming_what_was_not_checked_and_why(tmp_path):
    (tmp_path / "test_made.py").write_text(
        "import pytest\n\n"
        "def test_a():\n    pytest.skip('promtool is not installed; the rules are unchecked')\n\n"
        "def test_b():\n    pytest.skip('promtool is not installed')\n\n"
        "@pytest.mark.skip(reason='no SGLang venv')\ndef test_c():\n    pass\n\n"
        "def test_d():\n    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "tests.conftest", "-q", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert lines[-2] == "not checked: 3 skipped - promtool is not installed (2); no SGLang venv (1)", lines[-6:]

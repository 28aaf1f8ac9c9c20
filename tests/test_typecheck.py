"""tests/typecheck.py's comparison with its baseline, on planted mypy output: CI's type check fails where a file
gained errors and passes, with a hint, where counts fell. mypy itself does not run here (.ci/run runs it)."""

from __future__ import annotations

from tests.typecheck import REPORTED_PREFIX, UPDATE_HINT, check, parse_errors, per_file

# mypy's stdout as tests/typecheck.py asks for it: files under the link, notes between the errors.
STDOUT = f"""\
{REPORTED_PREFIX}config.py:10: error: Incompatible default for argument "port" (default has type "str")  [assignment]
{REPORTED_PREFIX}config.py:10: note: See https://mypy.readthedocs.io/en/stable/error_codes.html
{REPORTED_PREFIX}config.py:20: error: Item "None" of "Lease | None" has no attribute "release"  [union-attr]
{REPORTED_PREFIX}wire/http1.py:5: error: "None" not callable  [misc]
"""
COUNTS = {"gateway/config.py": 2, "gateway/wire/http1.py": 1}


def test_errors_are_counted_per_repo_path_and_code_and_notes_are_not_errors():
    errors = parse_errors(STDOUT)
    assert per_file(errors) == COUNTS
    assert [error.code for error in errors] == ["assignment", "union-attr", "misc"]
    assert errors[2].line == 'gateway/wire/http1.py:5: error: "None" not callable  [misc]'


def test_an_error_without_a_code_still_counts():
    (error,) = parse_errors(f"{REPORTED_PREFIX}app.py: error: Duplicate module named 'crossover.gateway.app'\n")
    assert (error.path, error.code) == ("gateway/app.py", "")


def test_counts_equal_to_the_baseline_pass_without_a_hint():
    outcome = check(COUNTS, STDOUT)
    assert outcome.ok
    assert UPDATE_HINT not in outcome.text


def test_a_file_with_more_errors_than_its_entry_fails_and_shows_its_errors():
    outcome = check({**COUNTS, "gateway/config.py": 1}, STDOUT)
    assert not outcome.ok
    assert "gateway/config.py: 2 errors, baseline 1:" in outcome.text
    assert 'gateway/config.py:20: error: Item "None" of "Lease | None"' in outcome.text
    assert "gateway/wire/http1.py:5" not in outcome.text  # only the files that grew are listed


def test_a_file_absent_from_the_baseline_with_errors_fails():
    outcome = check({"gateway/config.py": 2}, STDOUT)
    assert not outcome.ok
    assert "gateway/wire/http1.py: 1 error, baseline 0:" in outcome.text


def test_a_file_that_grew_fails_even_where_another_shrank_as_much():
    outcome = check({"gateway/config.py": 1, "gateway/wire/http1.py": 2}, STDOUT)
    assert not outcome.ok


def test_fewer_errors_pass_and_say_the_baseline_can_shrink():
    # gateway/errors.py has no errors left at all (or was moved): its entry can go.
    outcome = check({**COUNTS, "gateway/config.py": 3, "gateway/errors.py": 2}, STDOUT)
    assert outcome.ok
    assert "gateway/config.py: 2 errors, baseline 3" in outcome.text
    assert "gateway/errors.py: 0 errors, baseline 2" in outcome.text
    assert UPDATE_HINT in outcome.text

"""mypy on the gateway (`crossover.gateway`) against a baseline that may only shrink: tests/typecheck_baseline.json.

The gateway was written before a type checker ran on it, so it starts with errors. Fixing them all at once is not
the point; keeping new code from adding more is. CI fails when a file has more errors than its baseline entry, or
has errors and no entry; when counts fall it passes and says the baseline can shrink.

    python -m tests.typecheck            # check (.ci/run runs it)
    python -m tests.typecheck --update   # rewrite the baseline from this run's counts

Files are matched by path, so after moving or renaming files under gateway/ rewrite the baseline with --update:
the errors a move carries along then count under the new paths (the diff shows whether the total grew).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tests" / "typecheck_baseline.json"
PACKAGE = "crossover.gateway"
# The folder pyproject's package-dir installs as PACKAGE; the baseline's paths start with it.
SOURCE = "gateway"
# mypy's cache (relative to ROOT, gitignored): a warm run rechecks only what changed.
CACHE_DIR = ".mypy_cache"
# mypy cannot follow the editable install's import hook, and checking the folder gateway/ would name its modules
# `gateway.*`, so `from crossover.gateway.x import y` would not resolve to the files checked. A link laid out as
# installed, crossover/gateway -> gateway/, on MYPYPATH gives mypy the real module names. It lives in the cache
# folder to stay out of the tree (ruff and git ignore .mypy_cache).
LINK_ROOT = Path(CACHE_DIR) / "src"
LINK = LINK_ROOT / "crossover" / "gateway"
# mypy reports files by the path it found them at, under the link: this prefix maps them back to gateway/.
REPORTED_PREFIX = f"{LINK.as_posix()}/"
# The output shape parse_errors reads, whatever a local config says: one line an error, repo-relative path,
# `path:line: error: message  [code]`, no summary.
MYPY_FLAGS = [
    "--no-pretty",
    "--show-error-codes",
    "--hide-column-numbers",
    "--hide-absolute-path",
    "--no-color-output",
    "--no-error-summary",
]
# mypy's exit status when it ran and found no errors, or found some; anything else (2) is a crash, a usage error or
# a blocking error such as a syntax error, where the counts mean nothing.
CLEAN, FOUND_ERRORS = 0, 1
ERROR_LINE = re.compile(r"^(?P<path>[^:\s][^:]*)(?::\d+)*: error: .*?(?:  \[(?P<code>[\w-]+)\])?$")
UPDATE_HINT = "python -m tests.typecheck --update"


@dataclass(frozen=True)
class Error:
    path: str  # repo-relative: gateway/config.py
    line: str  # mypy's line, its path mapped back
    code: str  # mypy's error code; "" where it gives none


@dataclass(frozen=True)
class Outcome:
    ok: bool
    text: str


def parse_errors(stdout: str) -> list[Error]:
    """mypy's errors in its stdout (notes dropped: they explain an error, they are not one)."""
    errors = []
    for raw in stdout.splitlines():
        line = raw.replace(REPORTED_PREFIX, f"{SOURCE}/", 1) if raw.startswith(REPORTED_PREFIX) else raw
        match = ERROR_LINE.match(line)
        if match:
            errors.append(Error(path=match["path"], line=line, code=match["code"] or ""))
    return errors


def per_file(errors: list[Error]) -> dict[str, int]:
    return dict(sorted(Counter(error.path for error in errors).items()))


def plural(count: int) -> str:
    return f"{count} error{'' if count == 1 else 's'}"


def summary(errors: list[Error], baseline: dict[str, int]) -> str:
    codes = ", ".join(f"{code or 'no code'} {n}" for code, n in Counter(e.code for e in errors).most_common())
    return f"mypy: {plural(len(errors))} in {len(per_file(errors))} files, baseline {sum(baseline.values())}" + (
        f" ({codes})" if codes else ""
    )


def check(baseline: dict[str, int], stdout: str) -> Outcome:
    """mypy's stdout against the baseline: fails where a file's count grew (a file absent from it counts 0)."""
    errors = parse_errors(stdout)
    counts = per_file(errors)
    lines = [summary(errors, baseline)]
    grown = {path: n for path, n in counts.items() if n > baseline.get(path, 0)}
    for path, n in grown.items():
        # The baseline keeps counts only, so the new errors are shown among the file's others.
        lines.append(f"{path}: {plural(n)}, baseline {baseline.get(path, 0)}:")
        lines += [f"  {error.line}" for error in errors if error.path == path]
    if grown:
        lines.append(f"FAILED: more type errors than tests/typecheck_baseline.json allows in {len(grown)} files.")
        return Outcome(ok=False, text="\n".join(lines))
    shrunk = {path: n for path, n in baseline.items() if counts.get(path, 0) < n}
    for path, was in shrunk.items():
        lines.append(f"{path}: {plural(counts.get(path, 0))}, baseline {was}")
    if shrunk:
        lines.append(f"Fewer errors than the baseline: it can shrink, record it with `{UPDATE_HINT}`.")
    return Outcome(ok=True, text="\n".join(lines))


def link_package() -> None:
    link = ROOT / LINK
    link.parent.mkdir(parents=True, exist_ok=True)
    # Relative, so the link survives the checkout moving; remade each run, which costs nothing (mypy's cache keys
    # on the files' paths and contents, and those stay the same).
    link.unlink(missing_ok=True)
    link.symlink_to(os.path.relpath(ROOT / SOURCE, link.parent), target_is_directory=True)


def run_mypy() -> str:
    """mypy's stdout; fails the check (exit status 1) with mypy's output where it did not get to check the package."""
    link_package()
    command = [sys.executable, "-m", "mypy", "-p", PACKAGE, "--config-file", "pyproject.toml", "--cache-dir", CACHE_DIR]
    env = {**os.environ, "MYPYPATH": str(LINK_ROOT)}
    result = subprocess.run([*command, *MYPY_FLAGS], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    # Errors found but none parsed means the output's shape changed: counting 0 would pass by mistake.
    if result.returncode != (FOUND_ERRORS if parse_errors(result.stdout) else CLEAN):
        sys.exit(f"mypy did not check {PACKAGE} (exit status {result.returncode}):\n{result.stdout}{result.stderr}")
    return result.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.typecheck", description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline from this run's counts")
    args = parser.parse_args(argv)
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    stdout = run_mypy()
    if args.update:
        errors = parse_errors(stdout)
        BASELINE.write_text(json.dumps(per_file(errors), indent=2) + "\n")
        print(f"{summary(errors, baseline)}; baseline rewritten: {BASELINE.relative_to(ROOT)}")
        return 0
    outcome = check(baseline, stdout)
    print(outcome.text)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())

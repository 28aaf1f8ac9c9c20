"""`crossover patches`: the SGLang patches a deployment needs (patches/ at the top of the repository), applied to,
checked on and reverted from an installed SGLang tree - the pinned release only.

    crossover patches check  [--sglang PATH]   # applied / not applied / conflicts, per file; exit 0 only if applied
    crossover patches apply  [--sglang PATH]   # idempotent; verifies by importing every touched module
    crossover patches revert [--sglang PATH]

PATH is the `sglang` package directory or a directory that holds it (site-packages, an unzipped wheel); without
it, the tree the given `--python` (default: this interpreter) would import. The patch is applied in Python, hunk
by hunk with exact context (no fuzz, no offsets guessed across other code), to every file or to none: a tree
that matches neither the release nor the patched release is refused with the hunks that differ. After `apply`,
every touched module is imported in a fresh interpreter; if that fails the files are put back.

Exit codes: 0 done (check: applied), 1 failed (check: not applied), 2 bad input (no tree, wrong version).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from crossover.servers.sglang_check import SGLANG_VERSION

# patches/ sits beside servers/ in a checkout and in the editable install CI and users run.
PATCHES_ROOT = Path(__file__).resolve().parents[1] / "patches"
IMPORT_TIMEOUT_S = 300.0
_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.MULTILINE)
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")

_FIND_SCRIPT = (
    "import importlib.util as u; s = u.find_spec('sglang'); print(s.submodule_search_locations[0] if s else '')"
)
TreeState = Literal["applied", "not applied", "conflict"]


class PatchError(RuntimeError):
    """The tree cannot be patched as asked (conflicts, a failed import check); the message says why."""


class PatchRefused(PatchError):
    """Bad input: no SGLang tree there, or a release the patches are not for."""


@dataclass(frozen=True)
class Hunk:
    old_start: int  # 1-based line in the unpatched file
    new_start: int  # 1-based line in the patched file
    old: tuple[str, ...]
    new: tuple[str, ...]


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the directory that holds `sglang/`
    hunks: tuple[Hunk, ...]

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")


def patch_dir(version: str = SGLANG_VERSION) -> Path:
    return PATCHES_ROOT / f"sglang-{version}"


def load_patches(version: str = SGLANG_VERSION) -> list[FilePatch]:
    """Every file every `*.patch` of the release's folder touches, in order."""
    folder = patch_dir(version)
    files = sorted(folder.glob("*.patch"))
    if not files:
        raise PatchError(f"no patches for SGLang {version} in {folder}")
    return [fp for path in files for fp in parse_patch(path.read_text())]


def parse_patch(text: str) -> list[FilePatch]:
    """A unified diff (`git diff` or `diff -u`) -> its files and hunks. Only edits of existing files."""
    patches: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    path: str | None = None
    hunks: list[Hunk] = []
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ "):
            if path is not None:
                patches.append(FilePatch(path, tuple(hunks)))
            target = line[4:].strip().split("\t")[0]
            path = target[2:] if target.startswith("b/") else target
            hunks = []
            i += 1
            continue
        match = _HUNK_RE.match(line)
        if match is None:
            i += 1
            continue
        old_count = int(match.group(2) or 1)
        new_count = int(match.group(4) or 1)
        old: list[str] = []
        new: list[str] = []
        i += 1
        while (len(old) < old_count or len(new) < new_count) and i < len(lines):
            body = lines[i]
            if body.startswith("\\"):  # "\ No newline at end of file"
                i += 1
                continue
            tag, content = body[:1], body[1:]
            if tag in (" ", ""):
                old.append(content or "\n")
                new.append(content or "\n")
            elif tag == "-":
                old.append(content)
            elif tag == "+":
                new.append(content)
            else:
                raise PatchError(f"malformed hunk line in patch: {body!r}")
            i += 1
        hunks.append(Hunk(int(match.group(1)), int(match.group(3)), tuple(old), tuple(new)))
    if path is not None:
        patches.append(FilePatch(path, tuple(hunks)))
    return patches


def _apply_hunks(lines: list[str], hunks: tuple[Hunk, ...], reverse: bool) -> list[str] | None:
    """The file with every hunk applied (or undone), or None when any hunk's context is not exactly where the
    patch says (line numbers are the input file's own: the release's to apply, the patched one's to undo)."""
    out: list[str] = []
    cursor = 0
    for hunk in hunks:
        before, after = (hunk.new, hunk.old) if reverse else (hunk.old, hunk.new)
        start = (hunk.new_start if reverse else hunk.old_start) - (1 if before else 0)
        if start < cursor or tuple(lines[start : start + len(before)]) != before:
            return None
        out.extend(lines[cursor:start])
        out.extend(after)
        cursor = start + len(before)
    out.extend(lines[cursor:])
    return out


def _hunk_ok(lines: list[str], hunks: tuple[Hunk, ...], reverse: bool) -> bool:
    return _apply_hunks(lines, hunks, reverse) is not None


def locate(sglang: Path | None = None, python: str | None = None) -> Path:
    """The directory that holds the `sglang` package: from PATH (the package or its parent), else from what
    `python` (default: this interpreter) would import."""
    if sglang is not None:
        path = sglang.expanduser().resolve()
        if (path / "sglang" / "srt").is_dir():
            return path
        if path.name == "sglang" and (path / "srt").is_dir():
            return path.parent
        raise PatchRefused(f"{sglang} is neither an SGLang package directory nor a directory that holds `sglang/`")
    # A venv's python is a symlink to the base interpreter: only running it tells which site-packages it has.
    if python is None:
        spec = importlib.util.find_spec("sglang")
        where = list(spec.submodule_search_locations or []) if spec else []
    else:
        try:
            found = subprocess.run(
                [python, "-c", _FIND_SCRIPT], capture_output=True, text=True, timeout=60, check=False
            )
        except OSError as exc:
            raise PatchRefused(
                f"cannot run --python {python} ({exc.strerror}): give the Python of the environment SGLang is "
                "installed in (e.g. /path/to/venv/bin/python), or --sglang PATH"
            ) from None
        except subprocess.TimeoutExpired:
            raise PatchRefused(f"--python {python} did not answer within 60 s: is it a Python interpreter?") from None
        where = [found.stdout.strip()] if found.returncode == 0 and found.stdout.strip() else []
    if not where:
        raise PatchRefused(
            f"no SGLang installed for {python or sys.executable}: pass --sglang PATH (the sglang package directory "
            "or the site-packages that holds it)"
        )
    return Path(where[0]).resolve().parent


def tree_version(root: Path) -> str:
    """The release an SGLang tree is, from sglang/_version.py (what `sglang.__version__` reports)."""
    for name in ("_version.py", "version.py"):
        file = root / "sglang" / name
        if file.exists():
            match = _VERSION_RE.search(file.read_text())
            if match:
                return match.group(1)
    raise PatchRefused(f"cannot tell which SGLang release {root / 'sglang'} is (no __version__ in sglang/_version.py)")


@dataclass(frozen=True)
class FileState:
    path: str
    state: TreeState


def inspect(root: Path, patches: list[FilePatch]) -> list[FileState]:
    states: list[FileState] = []
    for fp in patches:
        file = root / fp.path
        if not file.exists():
            states.append(FileState(fp.path, "conflict"))
            continue
        lines = file.read_text().splitlines(keepends=True)
        if _hunk_ok(lines, fp.hunks, reverse=False):
            states.append(FileState(fp.path, "not applied"))
        elif _hunk_ok(lines, fp.hunks, reverse=True):
            states.append(FileState(fp.path, "applied"))
        else:
            states.append(FileState(fp.path, "conflict"))
    return states


def overall(states: list[FileState]) -> TreeState:
    kinds = {s.state for s in states}
    return kinds.pop() if len(kinds) == 1 else "conflict"


def _require_release(root: Path, version: str) -> None:
    found = tree_version(root)
    if found != version:
        raise PatchRefused(
            f"SGLang {found} at {root / 'sglang'}: these patches are for SGLang {version} only (the pinned "
            f"release; patches/sglang-{version}/). Install sglang=={version} or use patches made for {found}."
        )


def check(root: Path, version: str = SGLANG_VERSION) -> tuple[TreeState, list[FileState]]:
    _require_release(root, version)
    states = inspect(root, load_patches(version))
    return overall(states), states


def _rewrite(root: Path, patches: list[FilePatch], reverse: bool) -> list[str]:
    """Compute every file first (all or nothing), check each parses, then replace each atomically."""
    contents: dict[Path, str] = {}
    for fp in patches:
        file = root / fp.path
        new = _apply_hunks(file.read_text().splitlines(keepends=True), fp.hunks, reverse)
        if new is None:
            raise PatchError(f"{fp.path}: the patch's context is not there (the file was changed by something else)")
        text = "".join(new)
        ast.parse(text, filename=str(file))
        contents[file] = text
    for file, text in contents.items():
        temp = file.with_name(f".{file.name}.crossover-tmp")
        temp.write_text(text)
        os.chmod(temp, file.stat().st_mode & 0o777)
        os.replace(temp, file)
    return [fp.path for fp in patches]


def import_check(root: Path, modules: list[str], python: str | None = None, env: dict | None = None) -> str | None:
    """Import every module in a fresh interpreter with `root` first on sys.path: None, or the error."""
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), environ.get("PYTHONPATH", "")) if p)
    try:
        result = subprocess.run(
            [python or sys.executable, "-c", script, *modules],
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
            env=environ,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot import the touched modules: {exc}"
    if result.returncode != 0:
        return result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
    return None


@dataclass(frozen=True)
class Outcome:
    changed: bool
    message: str


def apply(
    root: Path,
    version: str = SGLANG_VERSION,
    *,
    verify: bool = True,
    python: str | None = None,
    env: dict | None = None,
) -> Outcome:
    """Apply the release's patches: already applied -> nothing changes; a conflict -> PatchError, nothing
    changes; an import failure afterwards -> the files are restored and PatchError says why."""
    state, states = check(root, version)
    patches = load_patches(version)
    if state == "applied":
        return Outcome(False, f"already applied to SGLang {version} at {root / 'sglang'}; nothing changed")
    if state == "conflict":
        raise PatchError(_conflict_message(root, states))
    touched = _rewrite(root, patches, reverse=False)
    if verify:
        error = import_check(root, [fp.module for fp in patches], python, env)
        if error is not None:
            _rewrite(root, patches, reverse=True)
            raise PatchError(f"patched modules do not import ({error}); the files were restored")
    return Outcome(True, f"applied to SGLang {version} at {root / 'sglang'}: " + ", ".join(touched))


def revert(root: Path, version: str = SGLANG_VERSION) -> Outcome:
    state, states = check(root, version)
    if state == "not applied":
        return Outcome(False, f"not applied at {root / 'sglang'}; nothing changed")
    if state == "conflict":
        raise PatchError(_conflict_message(root, states))
    touched = _rewrite(root, load_patches(version), reverse=True)
    return Outcome(True, f"reverted at {root / 'sglang'}: " + ", ".join(touched))


def _conflict_message(root: Path, states: list[FileState]) -> str:
    detail = ", ".join(f"{s.path} ({s.state})" for s in states if s.state != "applied")
    return (
        f"the tree at {root / 'sglang'} is neither the SGLang release nor the patched release: {detail}. "
        "Reinstall the release (pip install --force-reinstall --no-deps sglang=="
        + SGLANG_VERSION
        + ") and apply again."
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    patches = subparsers.add_parser(
        "patches",
        help=f"the SGLang {SGLANG_VERSION} patches (run-time speculation gate): apply, check, revert",
        description=__doc__.split("\n\n")[0],
    )
    sub = patches.add_subparsers(dest="patches_command", required=True, metavar="SUBCOMMAND")
    for name, text in (
        ("check", "say whether the patches are applied (exit 0 only if they are)"),
        ("apply", "apply the patches (idempotent) and import every touched module"),
        ("revert", "undo the patches"),
    ):
        command = sub.add_parser(name, help=text)
        command.add_argument("--sglang", type=Path, metavar="PATH", help="the sglang package or the dir that holds it")
        command.add_argument(
            "--python", metavar="PYTHON", help="the interpreter that runs SGLang (finds the tree; imports it)"
        )
        if name == "apply":
            command.add_argument(
                "--no-import-check", action="store_true", help="skip importing the touched modules afterwards"
            )
        command.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        root = locate(args.sglang, args.python)
        if args.patches_command == "check":
            state, states = check(root)
            for s in states:
                print(f"{s.state:12} {s.path}")
            print(f"SGLang {SGLANG_VERSION} at {root / 'sglang'}: patches {state}")
            return 0 if state == "applied" else 1
        if args.patches_command == "apply":
            outcome = apply(root, verify=not args.no_import_check, python=args.python)
        else:
            outcome = revert(root)
    except PatchRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(outcome.message)
    return 0

"""`crossover patches`: the engine patches a deployment needs (patches/ at the top of the repository), applied to,
checked on and reverted from an installed SGLang or vLLM tree - the pinned release, or SGLang main at pinned commits.

    crossover patches check  [--sglang PATH]   # applied / not applied / conflicts per file, and the target's
                                               # Starlette; exit 0 only if applied on Starlette >= 1.0.1
    crossover patches apply  [--sglang PATH]   # idempotent; verifies by importing every touched module
    crossover patches revert [--sglang PATH]   # also repairs a half-applied tree
    crossover patches check  --vllm PATH       # the same for vLLM (patches/vllm-<version>/)

The engine is the one named (`--sglang` / `--vllm`), else the one `--python` has installed (SGLang first); each
engine's series is the folder of its pinned release; vLLM has one for each release it was ported to
(`patches/vllm-0.32.0/`, `patches/vllm-0.34.0/`), chosen by the tree's version.

A release's folder holds a series (its `series` file names the order; without one, the `*.patch` files by name):
each patch is a diff of the tree the ones before it leave, `apply` puts on what is missing in order, `revert` takes
off what is there newest first, `check` reports each patch.

Two series: `sglang-0.5.23` (the pinned release, chosen by the tree's version) and `sglang-main` (SGLang's main at
the commits its `originals` file pins, chosen by probing: a tree that is not 0.5.23 - or has no version, as a
source checkout - gets the main series when every file it touches is that series' original or patched text).

PATH is the `sglang` package directory or a directory that holds it (site-packages, an unzipped wheel); without
it, the tree the given `--python` (default: this interpreter) would import. The patch is applied in Python, hunk
by hunk with exact context (no fuzz, no offsets guessed across other code), to every file or to none: a tree
that matches neither the release nor the patched release is refused with the hunks that differ. A tree where
some files are patched and the rest are the release's (a run cut short) is finished by `apply` and undone by
`revert`. After `apply`, every touched module is imported in a fresh interpreter; if that fails the files are
put back.

Writing is all or nothing under any failure: every new file is first written beside its target under a fresh
name (O_CREAT|O_EXCL|O_NOFOLLOW: never through a link someone planted) and the old entry kept as a hard link;
only then are the targets replaced, one rename each, and a failed rename puts back every entry already replaced.
A target that is not a regular file (a FIFO, a directory) or not UTF-8 text is refused before anything is
written.

Exit codes: 0 done (check: applied), 1 failed (check: not applied), 2 bad input (no tree, wrong version).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import secrets
import stat
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

# Below 1.0.1 Starlette builds request.url from the Host header, so `Host: x/health?` makes SGLang's auth
# middleware see a /health path and let a request through without a key.
STARLETTE_FLOOR = (1, 0, 1)
_STARLETTE_SCRIPT = "import starlette; print(starlette.__version__)"
_TEMP_ATTEMPTS = 8

_FIND_SCRIPT = (
    "import importlib.util as u, sys; s = u.find_spec(sys.argv[1]); print(s.submodule_search_locations[0] if s else '')"
)


@dataclass(frozen=True)
class Release:
    """A patchable engine: its package, the name it goes by, and a subpackage that tells its tree from another
    (`sglang/srt`, `vllm/v1`). Its series: `choose_series` (SGLang), `vllm_series` (vLLM)."""

    package: str
    title: str
    marker: str


RELEASES = {
    "sglang": Release("sglang", "SGLang", "srt"),
    "vllm": Release("vllm", "vLLM", "v1"),
}
TreeState = Literal["applied", "not applied", "partially applied", "conflict"]


class PatchError(RuntimeError):
    """The tree cannot be patched as asked (conflicts, a failed import check); the message says why."""


class PatchRefused(PatchError):
    """Bad input: no SGLang tree there, or a release the patches are not for."""


class NotInstalled(PatchRefused):
    """The interpreter runs but has no such engine installed (so another engine may be the one it has)."""


@dataclass(frozen=True)
class Hunk:
    old_start: int  # 1-based line in the unpatched file
    new_start: int  # 1-based line in the patched file
    old: tuple[str, ...]
    new: tuple[str, ...]


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the directory that holds the package (`sglang/`, `vllm/`)
    hunks: tuple[Hunk, ...]

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")


@dataclass(frozen=True)
class FileSeries:
    """One file's edits across the series: `(patch name, its hunks)` in series order. Each step's line numbers
    are the file as the steps before it left it, so the steps apply in order and undo in reverse."""

    path: str
    steps: tuple[tuple[str, tuple[Hunk, ...]], ...]

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")


# The series for SGLang's main branch: no release number, so a tree is matched by probing its files.
MAIN_SERIES = "main"


def patch_dir(version: str = SGLANG_VERSION, package: str = "sglang") -> Path:
    return PATCHES_ROOT / f"{package}-{version}"


def choose_series(root: Path) -> str:
    """The series that fits the SGLang tree at `root`: the pinned release's by version, else the main series
    when its files are there as the series knows them (original, partly or fully patched)."""
    try:
        found = tree_version(root)
    except PatchRefused:
        found = None
    if found == SGLANG_VERSION:
        return SGLANG_VERSION
    patches = load_patches(MAIN_SERIES)
    if all((root / fs.path).is_file() for fs in patches) and overall(inspect(root, patches)) != "conflict":
        return MAIN_SERIES
    raise PatchRefused(
        f"SGLang {found or '(no version)'} at {root / 'sglang'}: no series fits. patches/sglang-{SGLANG_VERSION}/ is "
        f"for SGLang {SGLANG_VERSION} only (the pinned release; install sglang=={SGLANG_VERSION}), "
        f"patches/sglang-{MAIN_SERIES}/ for SGLang main at the commits its `originals` file pins, which these files "
        "are not."
    )


def vllm_releases() -> list[str]:
    """The vLLM releases with a series: the `patches/vllm-<release>/` folders."""
    return sorted(path.name.removeprefix("vllm-") for path in PATCHES_ROOT.glob("vllm-*") if path.is_dir())


def vllm_series(root: Path) -> str:
    """The series that fits the vLLM tree at `root`: its release's folder. A tree of another release is refused:
    the same change lands on other lines there (0.34.0 moved seven of the nine files' hunks and rewrote the
    scheduler's lines one of them sits on)."""
    found = tree_version(root, "vllm")
    releases = vllm_releases()
    if found not in releases:
        raise PatchRefused(
            f"vLLM {found} at {root / 'vllm'}: these patches are for vLLM {' and '.join(releases)} only "
            f"(patches/vllm-<release>/). Install one of them, or port the series to {found}."
        )
    return found


def series_names(version: str = SGLANG_VERSION, package: str = "sglang") -> list[str]:
    """The release's patches in the order they apply: the folder's `series` file (quilt's convention: one name a
    line, `#` comments), else the `*.patch` files by name."""
    folder = patch_dir(version, package)
    listing = folder / "series"
    if listing.is_file():
        names = [line.split("#")[0].strip() for line in listing.read_text().splitlines()]
        names = [name for name in names if name]
    else:
        names = sorted(path.name for path in folder.glob("*.patch"))
    if not names:
        raise PatchError(f"no patches for {RELEASES[package].title} {version} in {folder}")
    return names


def load_patches(version: str = SGLANG_VERSION, package: str = "sglang") -> list[FileSeries]:
    """Every file the series touches, once, in the order the series first touches it, with its steps."""
    steps: dict[str, list[tuple[str, tuple[Hunk, ...]]]] = {}
    for name in series_names(version, package):
        for fp in parse_patch((patch_dir(version, package) / name).read_text()):
            steps.setdefault(fp.path, []).append((name, fp.hunks))
    return [FileSeries(path, tuple(file_steps)) for path, file_steps in steps.items()]


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


def _stage(lines: list[str], fs: FileSeries) -> int | None:
    """How many of the file's steps are applied (0 .. all), or None when the file is no stage of the series:
    the largest count whose steps undo back to a text on which the whole series applies again to this file."""
    for count in range(len(fs.steps), -1, -1):
        base = _run_steps(lines, reversed(fs.steps[:count]), reverse=True)
        if base is not None and _run_steps(base, fs.steps, reverse=False) is not None:
            return count
    return None


def _run_steps(lines: list[str], steps, reverse: bool) -> list[str] | None:
    """Each step's hunks applied (or undone) in the order given; None as soon as one does not fit."""
    for _name, hunks in steps:
        lines = _apply_hunks(lines, hunks, reverse)
        if lines is None:
            return None
    return lines


def locate(sglang: Path | None = None, python: str | None = None, package: str = "sglang") -> Path:
    """The directory that holds the engine's package (`sglang`, `vllm`): from PATH (the package or its parent),
    else from what `python` (default: this interpreter) would import."""
    release = RELEASES[package]
    if sglang is not None:
        path = sglang.expanduser().resolve()
        if (path / package / release.marker).is_dir():
            return path
        if path.name == package and (path / release.marker).is_dir():
            return path.parent
        raise PatchRefused(
            f"{sglang} is neither a {release.title} package directory nor a directory that holds `{package}/`"
        )
    # A venv's python is a symlink to the base interpreter: only running it tells which site-packages it has.
    if python is None:
        spec = importlib.util.find_spec(package)
        where = list(spec.submodule_search_locations or []) if spec else []
    else:
        try:
            found = subprocess.run(
                [python, "-c", _FIND_SCRIPT, package], capture_output=True, text=True, timeout=60, check=False
            )
        except OSError as exc:
            raise PatchRefused(
                f"cannot run --python {python} ({exc.strerror}): give the Python of the environment "
                f"{release.title} is installed in (e.g. /path/to/venv/bin/python), or --{package} PATH"
            ) from None
        except subprocess.TimeoutExpired:
            raise PatchRefused(f"--python {python} did not answer within 60 s: is it a Python interpreter?") from None
        where = [found.stdout.strip()] if found.returncode == 0 and found.stdout.strip() else []
    if not where:
        raise NotInstalled(
            f"no {release.title} installed for {python or sys.executable}: pass --{package} PATH (the {package} "
            "package directory or the site-packages that holds it)"
        )
    return Path(where[0]).resolve().parent


def installed(python: str | None) -> str:
    """The engine `python` (default: this interpreter) has installed: SGLang if it has both, else the one it has;
    PatchRefused when it has neither."""
    for package in RELEASES:
        try:
            locate(None, python, package)
        except NotInstalled:
            continue
        return package
    raise PatchRefused(
        f"neither SGLang nor vLLM is installed for {python or sys.executable}: pass --sglang PATH or --vllm PATH"
    )


def tree_version(root: Path, package: str = "sglang") -> str:
    """The release a tree is, from <package>/_version.py (what `sglang.__version__` / `vllm.__version__` reports)."""
    for name in ("_version.py", "version.py"):
        file = root / package / name
        if file.exists():
            match = _VERSION_RE.search(file.read_text())
            if match:
                return match.group(1)
    title = RELEASES[package].title
    raise PatchRefused(
        f"cannot tell which {title} release {root / package} is (no __version__ in {package}/_version.py)"
    )


@dataclass(frozen=True)
class FileState:
    path: str
    state: TreeState
    stage: int | None = None  # how many of the file's steps are applied; None: a conflict
    patches: tuple[str, ...] = ()  # the series' patches that touch the file, in order

    def patch_state(self, name: str) -> TreeState:
        """This file as far as one patch of the series goes."""
        if self.stage is None:
            return "conflict"
        return "applied" if self.patches.index(name) < self.stage else "not applied"


def read_source(file: Path) -> str:
    """A touched file's text, exactly (no newline translation); PatchError for anything but a regular UTF-8
    file - checked before opening, so a FIFO planted there cannot block the read."""
    try:
        mode = os.stat(file).st_mode
    except OSError as exc:
        raise PatchError(f"{file}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise PatchError(f"{file}: not a regular file; reinstall the release (the patches only edit its files)")
    try:
        return file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PatchError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start}); reinstall the release") from None
    except OSError as exc:
        raise PatchError(f"{file}: cannot read it ({exc.strerror})") from None


def _lines(file: Path) -> list[str]:
    return read_source(file).splitlines(keepends=True)


def inspect(root: Path, patches: list[FileSeries]) -> list[FileState]:
    states: list[FileState] = []
    for fs in patches:
        file = root / fs.path
        names = tuple(name for name, _hunks in fs.steps)
        stage = _stage(_lines(file), fs) if os.path.lexists(file) else None
        if stage is None:
            state: TreeState = "conflict"
        elif stage == len(fs.steps):
            state = "applied"
        else:
            state = "not applied" if stage == 0 else "partially applied"
        states.append(FileState(fs.path, state, stage, names))
    return states


def per_patch(
    states: list[FileState], version: str = SGLANG_VERSION, package: str = "sglang"
) -> list[tuple[str, TreeState]]:
    """Each patch of the series, in order, and how far the tree has it."""
    return [
        (name, overall([FileState(s.path, s.patch_state(name)) for s in states if name in s.patches]))
        for name in series_names(version, package)
    ]


def overall(states: list[FileState]) -> TreeState:
    kinds = {s.state for s in states}
    if "conflict" in kinds:
        return "conflict"
    return kinds.pop() if len(kinds) == 1 else "partially applied"


def _require_release(root: Path, version: str, package: str = "sglang") -> None:
    if version == MAIN_SERIES:
        return  # no release number: the series' own hunks are the check
    found = tree_version(root, package)
    if found != version:
        title = RELEASES[package].title
        raise PatchRefused(
            f"{title} {found} at {root / package}: these patches are for {title} {version} only (the pinned "
            f"release; patches/{package}-{version}/). Install {package}=={version} or use patches made for {found}."
        )


def check(root: Path, version: str = SGLANG_VERSION, package: str = "sglang") -> tuple[TreeState, list[FileState]]:
    _require_release(root, version, package)
    states = inspect(root, load_patches(version, package))
    return overall(states), states


def starlette_version(root: Path, python: str | None = None) -> str | None:
    """The Starlette the SGLang at `root` serves with: what `python` imports, else the copy beside `sglang/` in
    its site-packages; None when neither says."""
    if python is not None:
        try:
            found = subprocess.run(
                [python, "-c", _STARLETTE_SCRIPT], capture_output=True, text=True, timeout=60, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            found = None
        if found is not None and found.returncode == 0 and found.stdout.strip():
            return found.stdout.strip()
    init = root / "starlette" / "__init__.py"
    if init.is_file():
        match = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", init.read_text(errors="replace"), re.MULTILINE)
        if match:
            return match.group(1)
    return None


def starlette_ok(version: str) -> bool:
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:3])
    return numbers >= STARLETTE_FLOOR


def _exclusive(directory: Path, stem: str, suffix: str, create) -> Path:
    """A fresh name in `directory` made by `create(path)`, which must fail with FileExistsError when the name
    is taken (so nothing already there - a planted link - is ever opened or followed)."""
    for _ in range(_TEMP_ATTEMPTS):
        path = directory / f".{stem}.{secrets.token_hex(6)}.{suffix}"
        try:
            create(path)
        except FileExistsError:
            continue
        return path
    raise PatchError(f"cannot make a temporary file beside {directory / stem}: every name tried was taken")


def _write_new(file: Path, text: str) -> Path:
    """`text` in a new file beside `file`, with `file`'s permissions, synced."""
    mode = os.stat(file).st_mode & 0o777
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fds: list[int] = []
    temp = _exclusive(file.parent, file.name, "crossover-new", lambda path: fds.append(os.open(path, flags, 0o600)))
    try:
        with os.fdopen(fds[0], "wb") as out:
            out.write(text.encode("utf-8"))
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp, mode)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


def _keep_old(file: Path) -> Path:
    """A second name for `file`'s entry as it is (a regular file or a link), to put back on failure."""
    return _exclusive(file.parent, file.name, "crossover-old", lambda path: os.link(file, path, follow_symlinks=False))


def _rewrite(root: Path, patches: list[FileSeries], reverse: bool) -> list[str]:
    """Compute every file first (from the stage it is at, the series' remaining steps in order, or its applied
    steps undone newest first) and check each parses, write them all beside their targets, then swap them in;
    any failure leaves every target as it was."""
    contents: dict[Path, str] = {}
    for fs in patches:
        file = root / fs.path
        lines = _lines(file)
        stage = _stage(lines, fs)
        new = None
        if stage is not None:
            new = _run_steps(lines, reversed(fs.steps[:stage]) if reverse else fs.steps[stage:], reverse)
        if new is None:
            raise PatchError(f"{fs.path}: the patch's context is not there (the file was changed by something else)")
        text = "".join(new)
        ast.parse(text, filename=str(file))
        contents[file] = text
    staged: list[tuple[Path, Path, Path]] = []  # (target, new, old)
    replaced: list[tuple[Path, Path]] = []
    try:
        for file, text in contents.items():
            new = _write_new(file, text)
            try:
                old = _keep_old(file)
            except BaseException:
                new.unlink(missing_ok=True)
                raise
            staged.append((file, new, old))
        for file, new, old in staged:
            os.replace(new, file)
            replaced.append((file, old))
    except (OSError, PatchError) as exc:
        undone = _put_back(replaced)
        for _file, new, old in staged:
            new.unlink(missing_ok=True)
            old.unlink(missing_ok=True)
        what = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
        if undone:
            raise PatchError(
                f"writing the patched files failed: {what}{where}; these could not be put back: "
                + ", ".join(map(str, undone))
                + ". Run `crossover patches revert`, or reinstall the release."
            ) from None
        raise PatchError(f"writing the patched files failed: {what}{where}; nothing was changed") from None
    for _file, _new, old in staged:
        old.unlink(missing_ok=True)
    return [str(file.relative_to(root)) for file in contents]


def _put_back(replaced: list[tuple[Path, Path]]) -> list[Path]:
    """Every replaced target back to its old entry, newest first; the targets that could not be."""
    failed: list[Path] = []
    for file, old in reversed(replaced):
        try:
            os.replace(old, file)
        except OSError:
            failed.append(file)
    return failed


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
    package: str = "sglang",
) -> Outcome:
    """Apply the release's patches: already applied -> nothing changes; a conflict -> PatchError, nothing
    changes; partially applied -> the rest is applied; an import failure afterwards -> the files this run
    changed are restored and PatchError says why."""
    state, states = check(root, version, package)
    title = RELEASES[package].title
    if state == "applied":
        return Outcome(False, f"already applied to {title} {version} at {root / package}; nothing changed")
    if state == "conflict":
        raise PatchError(_conflict_message(root, states, version, package))
    todo = _files_in(version, states, ("not applied", "partially applied"), package)
    touched = _rewrite(root, todo, reverse=False)
    if verify:
        error = import_check(root, [fp.module for fp in load_patches(version, package)], python, env)
        if error is not None:
            _rewrite(root, todo, reverse=True)
            raise PatchError(f"patched modules do not import ({error}); the files were restored")
    finished = " (finished a partial apply)" if state == "partially applied" else ""
    return Outcome(True, f"applied to {title} {version} at {root / package}{finished}: " + ", ".join(touched))


def revert(root: Path, version: str = SGLANG_VERSION, package: str = "sglang") -> Outcome:
    state, states = check(root, version, package)
    if state == "not applied":
        return Outcome(False, f"not applied at {root / package}; nothing changed")
    if state == "conflict":
        raise PatchError(_conflict_message(root, states, version, package))
    touched = _rewrite(root, _files_in(version, states, ("applied", "partially applied"), package), reverse=True)
    return Outcome(True, f"reverted at {root / package}: " + ", ".join(touched))


def _files_in(
    version: str, states: list[FileState], wanted_states: tuple[TreeState, ...], package: str = "sglang"
) -> list[FileSeries]:
    wanted = {s.path for s in states if s.state in wanted_states}
    return [fp for fp in load_patches(version, package) if fp.path in wanted]


def _conflict_message(
    root: Path, states: list[FileState], version: str = SGLANG_VERSION, package: str = "sglang"
) -> str:
    detail = ", ".join(f"{s.path} ({s.state})" for s in states if s.state == "conflict")
    title = RELEASES[package].title
    return (
        f"the tree at {root / package} is neither the {title} release nor the patched release: {detail}. "
        f"Reinstall the release (pip install --force-reinstall --no-deps {package}=={version}) and apply again."
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    patches = subparsers.add_parser(
        "patches",
        help=f"the SGLang {SGLANG_VERSION} or main / vLLM {' or '.join(vllm_releases())} patches (run-time speculation "
        "gate): apply, check, revert",
        description=__doc__.split("\n\n")[0],
    )
    sub = patches.add_subparsers(dest="patches_command", required=True, metavar="SUBCOMMAND")
    for name, text in (
        ("check", "say whether the patches are applied (exit 0 only if they are)"),
        ("apply", "apply the patches (idempotent) and import every touched module"),
        ("revert", "undo the patches"),
    ):
        command = sub.add_parser(name, help=text)
        where = command.add_mutually_exclusive_group()
        where.add_argument("--sglang", type=Path, metavar="PATH", help="the sglang package or the dir that holds it")
        where.add_argument("--vllm", type=Path, metavar="PATH", help="the vllm package or the dir that holds it")
        command.add_argument(
            "--python", metavar="PYTHON", help="the interpreter that runs the engine (finds the tree; imports it)"
        )
        if name == "apply":
            command.add_argument(
                "--no-import-check", action="store_true", help="skip importing the touched modules afterwards"
            )
        command.set_defaults(run=_run)


def _report_starlette(root: Path, python: str | None) -> bool:
    """Say which Starlette the target serves with; whether it is below the floor."""
    version = starlette_version(root, python)
    floor = ".".join(map(str, STARLETTE_FLOOR))
    if version is None:
        print(f"Starlette: not found beside {root} (pass --python, the interpreter that runs SGLang, to check it)")
        return False
    if starlette_ok(version):
        print(f"Starlette {version} (>= {floor})")
        return False
    print(
        f"error: Starlette {version} serves this SGLang: below {floor}, a `Host: x/health?` header passes SGLang's "
        f"API-key check on every endpoint (the patch's POST checks its admin key itself, the rest of SGLang does "
        f"not). Install starlette>={floor} in SGLang's environment.",
        file=sys.stderr,
    )
    return True


def _run(args: argparse.Namespace) -> int:
    try:
        vllm_path = getattr(args, "vllm", None)
        if args.sglang is not None or vllm_path is not None:
            package = "sglang" if args.sglang is not None else "vllm"
        else:
            package = installed(args.python)
        release = RELEASES[package]
        root = locate(args.sglang or vllm_path, args.python, package)
        # SGLang has two series (the pinned release and main); vLLM one per release it has a folder for.
        series = choose_series(root) if package == "sglang" else vllm_series(root)
        if args.patches_command == "check":
            state, states = check(root, series, package)
            for name, patch_state in per_patch(states, series, package):
                print(f"{patch_state:17} {name}")
                for s in states:
                    if name in s.patches:
                        print(f"  {s.patch_state(name):15} {s.path}")
            # Starlette's Host-header bypass matters where the engine's auth middleware guards the gate (SGLang's).
            starlette_refused = package == "sglang" and _report_starlette(root, args.python)
            print(f"{release.title} {series} at {root / package} (patches/{package}-{series}/): patches {state}")
            return 0 if state == "applied" and not starlette_refused else 1
        if args.patches_command == "apply":
            outcome = apply(root, series, verify=not args.no_import_check, python=args.python, package=package)
        else:
            outcome = revert(root, series, package)
    except PatchRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(outcome.message)
    return 0

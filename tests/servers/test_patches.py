"""patches/sglang-0.5.23 on the real 0.5.23 release (the one in the SGLang venv .ci/run builds), through
`crossover patches`: applies, is idempotent, checks, reverts to the release byte for byte, refuses other releases
and foreign edits. Then, on the patched tree and on CPU (GPU-only packages stubbed at import, nothing else), the
tests shipped beside the patch in SGLang's layout (patches/sglang-0.5.23/test/srt/) run in that venv, each patch's
on its own tree: the gate's (policy and validation, the controller, the control path from the HTTP handler through
the tokenizer side and SGLang's own scheduler dispatcher back to the reply, TP over gloo) on the first patch alone,
slot replacement's on the whole series.

Writing is all or nothing: a write failing part-way, a planted temp-name link, a FIFO or undecodable bytes in the
tree leave it byte for byte as it was; `revert` repairs a tree a cut-short run left half-applied. The folder is a
series (the gate, then slot replacement on top of it): applied in order and reverted newest first, all or none.

The release tree is never modified: each test patches a farm of symlinks to it (the patcher replaces a file, it
never writes through one).

patches/sglang-main (the port to SGLang main): `crossover patches` picks a series by the tree's version, else by
probing its files; a tree no series fits is refused. With CROSSOVER_SGLANG_MAIN_FILES (the files its `originals`
pins), the main series is applied to them over the release's tree and its upstream-layout tests run on CPU."""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import random
import secrets
import subprocess
from pathlib import Path

import pytest

from crossover.servers import patches
from crossover.servers.sglang_check import SGLANG_VERSION, has_patch_test_dependencies, patch_test_site
from crossover.servers.sim.engine import Engine
from crossover.servers.sim.profile import load_profile
from crossover.servers.sim.speculation_gate import UPDATE_RESULTS, GateError, StandInGate
from tests.conftest import crossover_argv, missing_environment
from tests.servers.conftest import SGLANG_VENV
from tests.servers.sglang_inside.gate_bodies import BODIES

HERE = Path(__file__).resolve().parent
STUBS = HERE / "sglang_stubs"
INSIDE = HERE / "sglang_inside"
# The patch's own unittest files, in SGLang's test/srt/ layout: what an upstream PR would add.
SRT_TESTS = patches.patch_dir() / "test" / "srt"
SUITE_TIMEOUT_S = 600.0
# On CPU the touched modules import with the GPU-only packages stubbed and the patch tests' packages added.
CPU_IMPORT_PATH = os.pathsep.join(map(str, (STUBS, patch_test_site(SGLANG_VENV))))


@pytest.fixture(scope="module")
def patch_python(sglang_python: Path) -> Path:
    """The SGLang venv's interpreter, with what importing the patched modules needs (CI fails without it)."""
    if not has_patch_test_dependencies(SGLANG_VENV):
        missing_environment(
            f"{SGLANG_VENV} lacks the patch tests' packages: "
            f"run `python -m crossover.servers.sglang_check build {SGLANG_VENV}`"
        )
    return sglang_python


@pytest.fixture(scope="module")
def release(patch_python: Path) -> Path:
    """The directory holding the venv's (unpatched) sglang 0.5.23 package."""
    root = patches.locate(python=str(patch_python))
    assert patches.tree_version(root) == SGLANG_VERSION
    return root


def symlink_farm(source: Path, target: Path) -> Path:
    """`target/sglang`: real directories, every file a symlink into `source/sglang`."""
    for directory, _subdirs, files in os.walk(source / "sglang"):
        rel = Path(directory).relative_to(source)
        (target / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            os.symlink(Path(directory) / name, target / rel / name)
    return target


@pytest.fixture
def tree(release: Path, tmp_path: Path) -> Path:
    return symlink_farm(release, tmp_path / "tree")


def run_patches(*args: str, python: Path | None = None) -> subprocess.CompletedProcess:
    argv = crossover_argv("patches", *args, *(["--python", str(python)] if python else []))
    env = {**os.environ, "PYTHONPATH": CPU_IMPORT_PATH}
    return subprocess.run(argv, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S, env=env, check=False)


def touched(tree: Path) -> dict[str, bytes]:
    return {fp.path: (tree / fp.path).read_bytes() for fp in patches.load_patches()}


def test_apply_is_idempotent_check_says_so_and_revert_restores_the_release(tree, release, patch_python):
    before = touched(tree)
    result = run_patches("check", "--sglang", str(tree))
    assert result.returncode == 1 and "patches not applied" in result.stdout, result.stdout

    result = run_patches("apply", "--sglang", str(tree / "sglang"), python=patch_python)
    assert result.returncode == 0, result.stderr
    assert "applied to SGLang 0.5.23" in result.stdout
    applied = touched(tree)
    assert all(applied[path] != before[path] for path in before)

    result = run_patches("apply", "--sglang", str(tree), python=patch_python)
    assert result.returncode == 0 and "already applied" in result.stdout and "nothing changed" in result.stdout
    assert touched(tree) == applied
    assert run_patches("check", "--sglang", str(tree)).returncode == 0

    result = run_patches("revert", "--sglang", str(tree))
    assert result.returncode == 0, result.stderr
    assert touched(tree) == before == {path: (release / path).read_bytes() for path in before}
    assert run_patches("revert", "--sglang", str(tree)).stdout.startswith("not applied")


def test_another_release_is_refused_and_left_alone(tree):
    version = tree / "sglang" / "_version.py"
    text = version.read_text().replace("'0.5.23'", "'0.5.24'")
    version.unlink()
    version.write_text(text)
    before = touched(tree)
    result = run_patches("apply", "--sglang", str(tree))
    assert result.returncode == 2
    assert "SGLang 0.5.24" in result.stderr and "for SGLang 0.5.23 only" in result.stderr
    assert touched(tree) == before


def test_a_tree_changed_by_something_else_is_refused_whole(tree):
    target = tree / "sglang/srt/managers/io_struct.py"
    text = target.read_text().replace(
        "class GetHiCacheL3LayoutReq(BaseReq, kw_only=True):",
        "class GetHiCacheL3LayoutReq(BaseReq, kw_only=True):  # local",
    )
    target.unlink()
    target.write_text(text)
    before = touched(tree)
    result = run_patches("apply", "--sglang", str(tree))
    assert result.returncode == 1
    assert "io_struct.py (conflict)" in result.stderr
    assert touched(tree) == before  # all or nothing: not even the files that would have applied


def test_an_import_failure_puts_the_files_back(tree, patch_python):
    # Without the CPU stubs and packages the touched modules cannot import here: apply must undo itself.
    before = touched(tree)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        crossover_argv("patches", "apply", "--sglang", str(tree), "--python", str(patch_python)),
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        env=env,
        check=False,
    )
    assert result.returncode == 1
    assert "do not import" in result.stderr and "restored" in result.stderr
    assert touched(tree) == before


def entries(tree: Path) -> dict[str, object]:
    """Every directory entry the patcher could touch, as it is: a link's target or a file's bytes."""
    found: dict[str, object] = {}
    for directory in {(tree / fp.path).parent for fp in patches.load_patches()}:
        for entry in directory.iterdir():
            key = str(entry.relative_to(tree))
            if entry.is_symlink():
                found[key] = ("link", os.readlink(entry))
            elif entry.is_file():
                found[key] = ("file", entry.read_bytes())
    return found


def cli(*argv: str) -> int:
    """`crossover patches ...` in this process, so a test can inject a failure into it."""
    args = argparse.Namespace(patches_command=argv[0], sglang=Path(argv[1]), python=None, no_import_check=True)
    return patches._run(args)


def test_a_write_failing_part_way_changes_nothing(tree, monkeypatch, capsys):
    before = entries(tree)
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 6:  # the sixth of nine files: five already replaced
            raise OSError(errno.EIO, "Input/output error", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(patches.os, "replace", replace)
    assert cli("apply", str(tree)) == 1
    error = capsys.readouterr().err
    assert "writing the patched files failed: Input/output error" in error and "nothing was changed" in error
    assert len(calls) == 6 + 5  # the five put back
    assert entries(tree) == before  # byte for byte, links still links, no temporary left behind
    monkeypatch.setattr(patches.os, "replace", real_replace)
    assert cli("apply", str(tree)) == 0


def test_a_planted_temp_name_link_is_not_followed(tree, tmp_path, monkeypatch):
    outside = tmp_path / "outside.py"
    outside.write_text("precious\n")
    for fp in patches.load_patches():
        file = tree / fp.path
        for kind in ("new", "old"):
            os.symlink(outside, file.parent / f".{file.name}.planted.crossover-{kind}")
    before, real_token_hex = entries(tree), secrets.token_hex

    monkeypatch.setattr(patches.secrets, "token_hex", lambda _n: "planted")  # every name taken
    assert cli("apply", str(tree)) == 1
    assert entries(tree) == before and outside.read_text() == "precious\n"

    names = iter(["planted"])  # the first name tried is taken, the rest are fresh
    monkeypatch.setattr(patches.secrets, "token_hex", lambda n: next(names, None) or real_token_hex(n))
    assert cli("apply", str(tree)) == 0
    assert outside.read_text() == "precious\n"
    after = entries(tree)
    assert all(after[name] == value for name, value in before.items() if "planted" in name)


def test_a_fifo_or_undecodable_bytes_are_refused_with_a_message(tree, release, capsys):
    fifo_path, binary_path = (fp.path for fp in patches.load_patches()[3:5])
    fifo, binary = tree / fifo_path, tree / binary_path
    fifo.unlink()
    os.mkfifo(fifo)
    before = entries(tree)
    assert cli("apply", str(tree)) == 1
    assert "not a regular file" in capsys.readouterr().err
    assert entries(tree) == before

    fifo.unlink()
    os.symlink(release / fifo_path, fifo)  # the release's file again
    binary.unlink()
    binary.write_bytes(b"# \xff\xfe not utf-8\n")
    before = entries(tree)
    assert cli("revert", str(tree)) == 1
    assert "not UTF-8 text" in capsys.readouterr().err
    assert entries(tree) == before


def test_revert_repairs_a_half_applied_tree_and_apply_finishes_one(tree, release):
    before = touched(tree)
    patches._rewrite(tree, patches.load_patches()[:5], reverse=False)  # a run cut short after five files
    result = run_patches("check", "--sglang", str(tree))
    assert result.returncode == 1 and "patches partially applied" in result.stdout
    result = run_patches("revert", "--sglang", str(tree))
    assert result.returncode == 0, result.stderr
    assert touched(tree) == before == {path: (release / path).read_bytes() for path in before}

    patches._rewrite(tree, patches.load_patches()[4:], reverse=False)
    assert cli("apply", str(tree)) == 0
    assert patches.check(tree)[0] == "applied"


def first_patch_only() -> list[patches.FileSeries]:
    """The series cut after its first patch: the gate as upstream would merge it before slot replacement."""
    return [patches.FileSeries(fs.path, fs.steps[:1]) for fs in patches.load_patches()]


def test_the_series_applies_in_order_check_reports_each_patch_revert_undoes_newest_first(tree, release, patch_python):
    assert patches.series_names() == ["runtime-speculation-gate.patch", "runtime-speculation-slots.patch"]
    before = touched(tree)
    patches._rewrite(tree, first_patch_only(), reverse=False)
    # The gate stands alone: every touched module imports with the first patch only.
    env = {"PYTHONPATH": CPU_IMPORT_PATH}
    assert patches.import_check(tree, [fs.module for fs in patches.load_patches()], str(patch_python), env) is None
    gate_only = touched(tree)
    assert "reset_config" not in gate_only["sglang/srt/managers/io_struct.py"].decode()

    result = run_patches("check", "--sglang", str(tree))
    assert result.returncode == 1 and "patches partially applied" in result.stdout, result.stdout
    lines = result.stdout.splitlines()
    assert "applied           runtime-speculation-gate.patch" in lines
    assert "not applied       runtime-speculation-slots.patch" in lines

    assert cli("apply", str(tree)) == 0  # finishes the series: the second patch on top of the first
    assert patches.check(tree)[0] == "applied"
    assert "reset_config" in (tree / "sglang/srt/managers/io_struct.py").read_text()
    assert cli("revert", str(tree)) == 0  # both undone, newest first
    assert touched(tree) == before == {path: (release / path).read_bytes() for path in before}

    # All or nothing across the series: the second patch's context broken in one file refuses the whole apply.
    target = tree / "sglang/srt/speculative/adaptive_runtime_state.py"
    patches._rewrite(tree, first_patch_only(), reverse=False)
    text = target.read_text().replace(
        "        captured = self.captured_steps\n", "        captured = self.captured_steps  # local\n"
    )
    target.unlink()
    target.write_text(text)
    broken = touched(tree)
    assert cli("apply", str(tree)) == 1
    assert touched(tree) == broken


def test_check_reports_the_targets_starlette_and_refuses_below_the_floor(tree, patch_python):
    assert cli("apply", str(tree)) == 0
    result = run_patches("check", "--sglang", str(tree), python=patch_python)
    assert result.returncode == 0, result.stderr
    assert "Starlette 1." in result.stdout  # the SGLang environment's own

    beside = tree / "starlette"  # tree/ stands for the site-packages that holds sglang/
    beside.mkdir()
    (beside / "__init__.py").write_text('__version__ = "0.46.2"\n')
    result = run_patches("check", "--sglang", str(tree))
    assert result.returncode == 1
    assert "Starlette 0.46.2" in result.stderr and "below 1.0.1" in result.stderr
    (beside / "__init__.py").write_text('__version__ = "1.0.1"\n')
    assert run_patches("check", "--sglang", str(tree)).returncode == 0


@pytest.fixture(scope="module")
def patched(release: Path, patch_python: Path, tmp_path_factory) -> Path:
    root = symlink_farm(release, tmp_path_factory.mktemp("patched"))
    outcome = patches.apply(root, python=str(patch_python), env={"PYTHONPATH": CPU_IMPORT_PATH})
    assert outcome.changed
    return root


def run_inside(patched: Path, patch_python: Path, *argv: str) -> subprocess.CompletedProcess:
    """`patch_python argv...` on the patched tree, on CPU, with the patch's tests and sglang_inside/ importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (patched, CPU_IMPORT_PATH, SRT_TESTS, INSIDE)))}
    return subprocess.run(
        [str(patch_python), *argv],
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        env=env,
        cwd=patched,
        check=False,
    )


@pytest.fixture(scope="module")
def gate_only(release: Path, tmp_path_factory) -> Path:
    """A tree with the series' first patch only: where the gate's own suites run, as upstream would test it."""
    root = symlink_farm(release, tmp_path_factory.mktemp("gate-only"))
    patches._rewrite(root, first_patch_only(), reverse=False)
    assert "reset_config" not in (root / "sglang/srt/managers/io_struct.py").read_text()
    return root


# Each patch brings its own suites: slot replacement's run on the whole series, every other on the gate alone.
SLOTS_SUITES = ("test_adaptive_spec_runtime_slots",)
SUITES = sorted(path.stem for path in SRT_TESTS.glob("test_*.py"))


@pytest.mark.timeout(SUITE_TIMEOUT_S)  # the TP suite starts two scheduler ranks, each importing SGLang
@pytest.mark.parametrize("suite", SUITES)
def test_patched_source_on_cpu(suite, request, patch_python):
    patched = request.getfixturevalue("patched" if suite in SLOTS_SUITES else "gate_only")
    result = run_inside(patched, patch_python, "-m", "unittest", "-v", suite)
    assert result.returncode == 0, result.stderr[-6000:]
    assert " OK" in result.stderr.splitlines()[-1] or result.stderr.rstrip().endswith("OK")
    # The suite ran against the patched tree, not the venv's release.
    assert "FAILED" not in result.stderr


def test_the_slots_suite_needs_the_second_patch(gate_only, patch_python):
    """The split is real: on the gate alone the slots suite cannot import what it tests."""
    assert set(SLOTS_SUITES) < set(SUITES)
    result = run_inside(gate_only, patch_python, "-m", "unittest", *SLOTS_SUITES)
    assert result.returncode != 0
    assert "validate_runtime_adaptive_config" in result.stderr, result.stderr[-4000:]


def test_the_stand_in_judges_every_body_as_the_patch_does(patched, patch_python):
    """The same bodies through the patch's normalizer and controller (in the SGLang venv, the stand-in's captured
    steps) and through the stand-in (in this process): the same status and reason for each; the same GET fields."""
    result = run_inside(patched, patch_python, str(INSIDE / "gate_parity.py"))
    assert result.returncode == 0, result.stderr[-4000:]
    patch = json.loads(result.stdout.splitlines()[-1])
    profile = load_profile("llama8b-h200-eagle3")

    def stand_in(body) -> list:
        gate = StandInGate(Engine(profile, random.Random(0)), profile.speculative.num_steps)
        try:
            gate.update(body)
        except GateError as exc:
            return [exc.status, exc.reason]
        return [200, ""]

    assert profile.speculative.num_steps == 3  # gate_parity.py's captured steps are 0 and 3
    verdicts = [stand_in(body) for body in BODIES]
    differ = [(b, v, p) for b, v, p in zip(BODIES, verdicts, patch["verdicts"], strict=True) if v != p]
    assert differ == [], differ
    assert {status for status, _ in verdicts} == {200, 400, 409}
    state = StandInGate(Engine(profile, random.Random(0)), 3).state()
    assert sorted(set(state) - {"decode_batches", "zero_step_batches"}) == patch["get_fields"]
    # The metrics the stand-in exports are the ones the patch adds.
    text = (patches.patch_dir() / "runtime-speculation-gate.patch").read_text()
    for name in ("zero_steps_above_bs", "policy_generation", "policy_updates_total"):
        assert f'name="sglang:spec_adaptive_{name}"' in text
    assert "by result (applied, rejected, conflict, failed)" in text and UPDATE_RESULTS == (
        "applied",
        "rejected",
        "conflict",
        "failed",
    )


# -- The main series (patches/sglang-main/): chosen by probing, applied on SGLang main's own files ----------------

MAIN_DIR = patches.patch_dir(patches.MAIN_SERIES)
MAIN_TESTS = MAIN_DIR / "test" / "registered" / "unit" / "speculative"
# A directory holding the files `originals` pins (sglang/srt/...), taken from sgl-project/sglang at those commits.
MAIN_FILES = os.environ.get("CROSSOVER_SGLANG_MAIN_FILES")


def main_originals() -> list[tuple[str, str, str]]:
    """(commit, sha256, path) of every file the main series was written against."""
    rows = [line.split() for line in (MAIN_DIR / "originals").read_text().splitlines() if not line.startswith("#")]
    return [(commit, digest, path) for commit, digest, path in (row for row in rows if row)]


def test_check_chooses_the_series_by_version_and_refuses_a_tree_no_series_fits(tree):
    assert patches.choose_series(tree) == SGLANG_VERSION
    main_series = ["adaptive-config-schema.patch", "runtime-speculation-gate.patch"]
    assert patches.series_names(patches.MAIN_SERIES) == main_series
    # The series' own files are the ones `originals` pins (plus the router the patched module imports).
    touched_by_main = {fs.path for fs in patches.load_patches(patches.MAIN_SERIES)}
    assert touched_by_main < {path for _commit, _digest, path in main_originals()}

    # Without a version (a source checkout) the files decide: the release's are not main's.
    (tree / "sglang/_version.py").unlink()
    with pytest.raises(patches.PatchRefused, match="no series fits"):
        patches.choose_series(tree)
    result = run_patches("check", "--sglang", str(tree))
    assert result.returncode == 2 and "no series fits" in result.stderr, result.stderr


@pytest.fixture(scope="module")
def main_tree(release: Path, tmp_path_factory) -> Path:
    """The release's tree with SGLang main's pinned files over it and no version file, as a main checkout has."""
    if MAIN_FILES is None:
        pytest.skip("CROSSOVER_SGLANG_MAIN_FILES is not set (the pinned main files; patches/sglang-main/originals)")
    root = symlink_farm(release, tmp_path_factory.mktemp("main"))
    (root / "sglang/_version.py").unlink()
    for _commit, digest, path in main_originals():
        text = (Path(MAIN_FILES) / path).read_bytes()
        assert hashlib.sha256(text).hexdigest() == digest, f"{path} is not the pinned main file"
        target = root / path
        if os.path.lexists(target):
            target.unlink()  # a link into the release: replace it, never write through it
        target.write_bytes(text)
    return root


@pytest.mark.timeout(SUITE_TIMEOUT_S)
def test_the_main_series_applies_to_mains_files_and_its_tests_pass_on_cpu(main_tree, patch_python):
    pristine = {path: (main_tree / path).read_bytes() for _c, _d, path in main_originals()}
    result = run_patches("check", "--sglang", str(main_tree), python=patch_python)
    assert result.returncode == 1 and "(patches/sglang-main/): patches not applied" in result.stdout, result.stdout
    result = run_patches("apply", "--sglang", str(main_tree), python=patch_python)
    assert result.returncode == 0, result.stderr
    result = run_patches("check", "--sglang", str(main_tree), python=patch_python)
    assert result.returncode == 0 and "patches applied" in result.stdout, result.stdout

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (main_tree, CPU_IMPORT_PATH, MAIN_TESTS)))}
    suite = subprocess.run(
        [str(patch_python), "-m", "unittest", "-v", "test_adaptive_spec_runtime_gate"],
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        env=env,
        cwd=main_tree,
        check=False,
    )
    assert suite.returncode == 0 and suite.stderr.rstrip().endswith("OK"), suite.stderr[-6000:]

    assert run_patches("revert", "--sglang", str(main_tree)).returncode == 0
    assert {path: (main_tree / path).read_bytes() for path in pristine} == pristine

"""patches/sglang-0.5.23 on the real 0.5.23 release (the one in the SGLang venv .ci/run builds), through
`crossover patches`: applies, is idempotent, checks, reverts to the release byte for byte, refuses other releases
and foreign edits. Then, on the patched tree and on CPU (GPU-only packages stubbed at import, nothing else), the
suites in sglang_inside/ run in that venv: policy and validation, the controller, and the control path from the
HTTP handler through the tokenizer side and SGLang's own scheduler dispatcher back to the reply.

The release tree is never modified: each test patches a farm of symlinks to it (the patcher replaces a file, it
never writes through one)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from crossover.servers import patches
from crossover.servers.sglang_check import SGLANG_VERSION, has_patch_test_dependencies, patch_test_site
from tests.conftest import crossover_argv, missing_environment
from tests.servers.conftest import SGLANG_VENV

HERE = Path(__file__).resolve().parent
STUBS = HERE / "sglang_stubs"
INSIDE = HERE / "sglang_inside"
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


@pytest.fixture(scope="module")
def patched(release: Path, patch_python: Path, tmp_path_factory) -> Path:
    root = symlink_farm(release, tmp_path_factory.mktemp("patched"))
    outcome = patches.apply(root, python=str(patch_python), env={"PYTHONPATH": CPU_IMPORT_PATH})
    assert outcome.changed
    return root


@pytest.mark.parametrize("suite", ["check_policy", "check_controller", "check_control_path"])
def test_patched_source_on_cpu(suite, patched, patch_python):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (patched, CPU_IMPORT_PATH, INSIDE)))}
    env.pop("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND", None)
    result = subprocess.run(
        [str(patch_python), "-m", "unittest", "-v", suite],
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
        env=env,
        cwd=patched,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    assert " OK" in result.stderr.splitlines()[-1] or result.stderr.rstrip().endswith("OK")
    # The suite ran against the patched tree, not the venv's release.
    assert "FAILED" not in result.stderr

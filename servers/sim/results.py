"""A load tester's results.json (loadtest/, SGLang bench_serving field names) as a measured profile.

Per target and concurrency: per-request speed = 1000 / mean_tpot_ms, TTFT = mean_ttft_ms / 1000. Levels
without completed requests (or without the two means) are skipped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from crossover.servers.sim.profile_file import ProfileError


def measured_profile_data(path: Path, target: str | None) -> dict[str, Any]:
    """A results.json target as measured-profile data: per-request speed = 1 / mean TPOT, TTFT = mean TTFT."""
    where = str(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{where}: cannot read a results file: {exc}") from None
    levels = data.get("levels") if isinstance(data, dict) else None
    if not isinstance(levels, list):
        raise ProfileError(f"{where}: not a results.json (no 'levels' list)")
    targets = sorted({lv.get("target") for lv in levels if isinstance(lv, dict)} - {None})
    if target is None:
        if len(targets) != 1:
            raise ProfileError(f"{where}: holds targets {targets}; pick one with --target (or target = ... in TOML)")
        target = targets[0]
    elif target not in targets:
        raise ProfileError(f"{where}: no target {target!r}; it holds {targets}")
    points = []
    for lv in levels:
        if not isinstance(lv, dict) or lv.get("target") != target or not lv.get("completed"):
            continue
        tpot, ttft, conc = lv.get("mean_tpot_ms"), lv.get("mean_ttft_ms"), lv.get("concurrency")
        numbers = all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in (tpot, ttft, conc)
        )
        if numbers and tpot > 0:
            points.append({"concurrency": conc, "per_request_throughput": 1000.0 / tpot, "ttft_s": ttft / 1000.0})
    if not points:
        raise ProfileError(f"{where}: target {target!r} has no level with completed requests, TPOT and TTFT")
    metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    model = metadata.get("model")
    return {
        "kind": "measured",
        "target": target,
        "model_name": model if isinstance(model, str) and model else f"measured-{target}",
        "description": f"measured curve of target {target!r} replayed from {path.name}",
        "points": points,
    }

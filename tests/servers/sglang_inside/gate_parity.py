"""What the patched source answers to each of gate_bodies.BODIES, on a server whose captured step counts are the
stand-in's (0 and 3, no CUDA graphs), each body on a fresh policy at generation 0; and the fields its GET returns.
Prints JSON for tests/servers/test_patches.py to compare with the stand-in."""

import json

from gate_bodies import BODIES
from sglang.srt.speculative.adaptive_runtime_state import AdaptiveUpdateConflict
from sglang.srt.speculative.adaptive_spec_params import parse_runtime_update_body
from test_adaptive_spec_runtime_controller import started_controller

STAND_IN_CONFIG = {"1": {"candidate_steps": [3]}, "2": {"candidate_steps": [0]}}


def verdict(body):
    try:
        fields = parse_runtime_update_body(body)
    except ValueError:
        return [400, "invalid_body"]
    _worker, controller = started_controller(cfg=STAND_IN_CONFIG, graph_bs=None)
    try:
        controller.update_runtime_config(**fields)
    except AdaptiveUpdateConflict:
        return [409, "stale_generation"]
    except ValueError:
        return [400, "rejected"]
    return [200, ""]


if __name__ == "__main__":
    _worker, controller = started_controller(cfg=STAND_IN_CONFIG, graph_bs=None)
    print(json.dumps({"verdicts": [verdict(b) for b in BODIES], "get_fields": sorted(controller.runtime_config())}))

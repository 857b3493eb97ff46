"""`python -m tests.hooks.broken_paths [serve flags]`: the server with paths that fail, for tests only.

VITSERVE_TEST_BROKEN names them, comma-separated: "graphs/image" makes every replay of an image graph
raise, "eager/video" every eager forward of videos; the start-up self-check (graphs/self_check.py) must
find them; "fp8_gate" puts the FP8 agreement bar (graphs/precision.py) out of reach. Engine processes import
this module again as their main module, so the faults apply there.
"""

import os
import sys

from graphs.pool import GraphPool
from graphs.runner import GraphRunner

BROKEN = {p for p in os.environ.get("VITSERVE_TEST_BROKEN", "").split(",") if p}
_replay, _eager = GraphPool.replay, GraphRunner.eager


def _broken_replay(self, key, pixels, grids):
    if f"graphs/{key.modality}" in BROKEN:
        raise RuntimeError("injected replay failure")
    return _replay(self, key, pixels, grids)


def _broken_eager(self, pixels, grids, modality="image"):
    if f"eager/{modality}" in BROKEN:
        raise RuntimeError("injected eager failure")
    return _eager(self, pixels, grids, modality)


GraphPool.replay = _broken_replay  # type: ignore[method-assign]
GraphRunner.eager = _broken_eager  # type: ignore[method-assign]
if "fp8_gate" in BROKEN:
    import graphs.precision

    _gate = graphs.precision.quantize_with_gate
    graphs.precision.quantize_with_gate = lambda tower, device, video: _gate(tower, device, video, mean_bar=1.01)

if __name__ == "__main__":
    from service.http.server import main

    sys.exit(main())

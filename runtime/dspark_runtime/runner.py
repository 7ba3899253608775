"""What the step loop needs from whatever runs an engine's graphs: a `GraphRunner` per graph, opened by a `Backend`.

A runner knows its graph's I/O contract (`io`), takes one call's batch (`TargetBatch` or `DraftBatch`), and
commits the K/V the call computed into its own caches before it returns, so that the step loop never touches a
cache. ONNX Runtime (`dspark_runtime.backend.OrtBackend`) is one backend; the tests run the step loop on a small
pure-numpy one too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dspark_common.engine_dir import Manifest
from dspark_common.graph_io import GraphIO


class Batch(Protocol):
    def feeds(self, io: GraphIO) -> dict[str, np.ndarray]:
        """The graph's inputs (caches aside), as its contract names them."""

    def cache_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(slot, position) of each row whose K/V the call commits."""


class GraphRunner(Protocol):
    io: GraphIO

    def run(self, batch: Batch) -> dict[str, np.ndarray]:
        """Run one call, commit its K/V rows to the caches, and return the graph's other outputs by name."""


class Backend(Protocol):
    def open(self, folder: Path, manifest: Manifest) -> tuple[GraphRunner, GraphRunner | None]:
        """(target, drafter) runners of an engine directory (no drafter runner for a target-only engine)."""

    def machine(self) -> dict[str, Any]:
        """What a speed curve measured with these runners records of them (a curve from elsewhere is re-measured)."""

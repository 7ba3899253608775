"""ONNX Runtime sessions for the engine's graphs (TensorRT engines are not wired yet).

On 2 cores, two sessions with default settings ran at half the speed of one because their spinning
intra-op pools fought (research/feasibility.md §5): a pool keeps spinning for a while after its run returns,
on the cores the other session's run needs. Here both pools spin during a run (fast hand-offs between ops)
and stop the moment it returns (`session.force_spinning_stop`), so the target and the drafter each get every
core without a fight. Measured on the demo against the previous setting (drafter on one thread, only the
target's pool spinning; four alternating pairs of `dspark-run bench --modes off,fixed:7 --domains code
--limit 10`): the drafter's share of a `fixed:7` step 27% -> 24%, `fixed:7` / `off` 1.70x -> 1.82x (medians).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError, MissingDependencyError


def available_providers() -> list[str]:
    import onnxruntime as ort

    return ort.get_available_providers()


class OrtGraph:
    """One ONNX graph in an InferenceSession; `run(feeds)` returns every output by name."""

    def __init__(self, path: Path, threads: int, providers: list[str] | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers or ["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise DSparkError(f"onnxruntime cannot load {path.name}: {exc}") from None
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        used = {name: value for name, value in feeds.items() if name in self.inputs}
        return dict(zip(self.output_names, self.session.run(self.output_names, used)))


def open_graphs(folder: Path, backend: str, has_drafter: bool, threads: int | None = None,
                providers: list[str] | None = None) -> tuple[OrtGraph, OrtGraph | None]:
    """(target, drafter) runners for an engine directory."""
    if backend == "trt":
        raise MissingDependencyError("the TensorRT runtime backend is not available yet; use backend='ort'")
    if providers and "CUDAExecutionProvider" in providers and "CUDAExecutionProvider" not in available_providers():
        raise MissingDependencyError("CUDA was requested but onnxruntime has no CUDA provider: pip install 'dspark[gpu]'")
    threads = threads or os.cpu_count() or 1
    target = OrtGraph(folder / "target.onnx", threads, providers)
    drafter = OrtGraph(folder / "drafter.onnx", threads, providers) if has_drafter else None
    return target, drafter

"""ONNX Runtime sessions for the engine's graphs (the runtime has no TensorRT backend yet).

On 2 cores, two sessions with default settings ran at half the speed of one because their spinning
intra-op pools fought (measured in the project's feasibility study): a pool keeps spinning for a while after its run returns,
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

from dspark_runtime.engine_dir import DRAFTER_GRAPH, TARGET_GRAPH, EngineError, Manifest
from dspark_runtime.errors import DSparkError, MissingDependencyError
from dspark_runtime.graph_io import GraphIO
from dspark_runtime.kv_cache import KVCache

ORT_TYPES = {"int64": "tensor(int64)", "float32": "tensor(float)", "float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)"}


def available_providers() -> list[str]:
    import onnxruntime as ort

    return ort.get_available_providers()


class OrtGraph:
    """One ONNX graph in an InferenceSession, checked against its contract, with its KV caches bound once (for an
    in-place graph as both its past inputs and present outputs). `run(feeds)` takes exactly the graph's other
    inputs and returns its other outputs by name."""

    def __init__(self, path: Path, io: GraphIO, threads: int, providers: list[str] | None = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        providers = providers or ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise DSparkError(f"onnxruntime cannot load {path.name}: {exc}") from None
        check_contract(self.session, io, path)
        self.io = io
        self.cache = KVCache(io, "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu")
        self.inputs = {name for name in io.input_names if name not in self.cache.values}
        self.binding = self.session.io_binding()
        for name, value in self.cache.values.items():
            self.binding.bind_ortvalue_input(name, value)
            if io.in_place:
                self.binding.bind_ortvalue_output("present_" + name.removeprefix("past_"), value)
        self.output_names = [name for name in io.output_names if not name.startswith("present_")]
        first = len(self.cache.values) if io.in_place else 0  # bound outputs come back in the order they were bound
        self.output_slice = slice(first, first + len(self.output_names))

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if feeds.keys() != self.inputs:
            missing, unknown = sorted(self.inputs - feeds.keys()), sorted(feeds.keys() - self.inputs)
            raise DSparkError(f"the {self.io.graph} graph was fed wrong inputs (missing {missing}, unknown {unknown})")
        binding = self.binding
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name in self.output_names:  # rebound every run: their shapes change with the batch
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        values = binding.get_outputs()[self.output_slice]
        return {name: value.numpy() for name, value in zip(self.output_names, values)}


def check_contract(session, io: GraphIO, path: Path) -> None:
    """Refuse a graph whose inputs or outputs differ from the contract in name, type or a fixed dimension."""
    declared = {a.name: a for a in list(session.get_inputs()) + list(session.get_outputs())}
    for tensor in io.inputs + io.outputs:
        arg = declared.pop(tensor.name, None)
        problem = None
        if arg is None:
            problem = f"has no {tensor.name!r}"
        elif arg.type != ORT_TYPES[tensor.dtype]:
            problem = f"has {tensor.name!r} as {arg.type}, the contract says {tensor.dtype}"
        elif len(arg.shape) != len(tensor.shape) or any(
                isinstance(want, int) and isinstance(got, int) and want != got for want, got in zip(tensor.shape, arg.shape)):
            problem = f"has {tensor.name!r} of shape {arg.shape}, the contract says {list(tensor.shape)}"
        if problem:
            break
    else:
        problem = f"has {sorted(declared)[0]!r}, which the contract does not know" if declared else None
    if problem:
        raise EngineError(f"{path.name} {problem}; rebuild the engine with `dspark-export build --force`")


def open_graphs(folder: Path, manifest: Manifest, backend: str, threads: int | None = None,
                providers: list[str] | None = None) -> tuple[OrtGraph, OrtGraph | None]:
    """(target, drafter) runners for an engine directory."""
    if backend == "trt":
        raise MissingDependencyError("the runtime cannot run TensorRT engines yet; load this engine with backend='ort' "
                                     "(ONNX Runtime runs its ONNX graphs)")
    if providers and "CUDAExecutionProvider" in providers and "CUDAExecutionProvider" not in available_providers():
        raise MissingDependencyError("CUDA was requested but onnxruntime has no CUDA provider: pip install 'dspark[gpu]'")
    threads = threads or os.cpu_count() or 1
    target = OrtGraph(folder / TARGET_GRAPH, manifest.target_io(), threads, providers)
    drafter_io = manifest.drafter_io()
    drafter = OrtGraph(folder / DRAFTER_GRAPH, drafter_io, threads, providers) if drafter_io else None
    return target, drafter

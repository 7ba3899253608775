"""The ONNX Runtime backend: a session per graph, each a `GraphRunner` (`dspark_runtime.runner`) holding its KV
caches (the runtime has no TensorRT runner yet).

The target and the drafter run one after the other on the same cores. With their own pools (the default,
safe beside other ONNX Runtime sessions in the same process) each pool spins during its run and stops the
moment the run returns (`session.force_spinning_stop`), so the two never fight over the cores; every run
then pays a wake-up. With `shared_pool` both sessions use the process's one pool (ONNX Runtime's global
thread pool) and keep spinning between runs, which is faster (docs/benchmarks.md, "Thread pools"). Its cost:
every ONNX Runtime session the process creates
afterwards must set `use_per_session_threads = False`, and the first engine loaded sets the pool's size.
The `dspark-run` commands use the shared pool (`DSPARK_THREAD_POOL=session` turns it off).
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark_common.engine_dir import DRAFTER_GRAPH, TARGET_GRAPH, Manifest
from dspark_common.errors import EngineError
from dspark_common.errors import DSparkError, MissingDependencyError
from dspark_common.graph_io import GraphIO
from dspark_common.native import operators_library, uses_operators
from dspark_runtime.kv_cache import KVCache
from dspark_runtime.runner import Batch

ORT_TYPES = {
    "int64": "tensor(int64)",
    "int32": "tensor(int32)",
    "float32": "tensor(float)",
    "float16": "tensor(float16)",
    "bfloat16": "tensor(bfloat16)",
}


def available_providers() -> list[str]:
    import onnxruntime as ort

    return ort.get_available_providers()


_POOL_THREADS: list[int] = []  # the size the process's shared pool was given


def share_thread_pool(threads: int) -> None:
    """Size ONNX Runtime's process-wide thread pool, once (later calls keep the first size)."""
    if not _POOL_THREADS:
        from onnxruntime.capi.onnxruntime_pybind11_state import set_global_thread_pool_sizes

        set_global_thread_pool_sizes(threads, 1)
        _POOL_THREADS.append(threads)


class OrtRunner:
    """One ONNX graph in an InferenceSession, checked against its contract, with its KV caches bound once (for an
    in-place graph as both its past inputs and present outputs, which the graph appends to itself; for the others
    the runner writes the graph's `new_*` rows at the batch's cache rows)."""

    def __init__(self, path: Path, io: GraphIO, threads: int, providers: list[str] | None = None,
                 shared_pool: bool = False):
        """A graph that imports DSpark's own `ai.dspark` operators (w4a8's, GGUF K-quants') gets their library."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        if uses_operators(path):
            options.register_custom_ops_library(str(operators_library()))
        if shared_pool:
            share_thread_pool(threads)
            options.use_per_session_threads = False
        else:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.add_session_config_entry("session.force_spinning_stop", "1")
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
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
        self.output_positions = range(first, first + len(self.output_names))

    def run(self, batch: Batch) -> dict[str, np.ndarray]:
        outputs = self.run_feeds(batch.feeds(self.io))
        if not self.io.in_place:
            self.cache.write(*batch.cache_rows(), outputs)
        return outputs

    def run_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on exactly the graph's other inputs (caches untouched but by an in-place graph)."""
        if feeds.keys() != self.inputs:
            missing, unknown = sorted(self.inputs - feeds.keys()), sorted(feeds.keys() - self.inputs)
            raise DSparkError(f"the {self.io.graph} graph was fed wrong inputs (missing {missing}, unknown {unknown})")
        binding = self.binding
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name in self.output_names:  # rebound every run: their shapes change with the batch
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        # the raw values: the public get_outputs() wraps every bound output, the caches too, each call
        values = binding._iobinding.get_outputs()
        return {name: values[index].numpy() for name, index in zip(self.output_names, self.output_positions)}


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
            isinstance(want, int) and isinstance(got, int) and want != got for want, got in zip(tensor.shape, arg.shape)
        ):
            problem = f"has {tensor.name!r} of shape {arg.shape}, the contract says {list(tensor.shape)}"
        if problem:
            break
    else:
        problem = f"has {sorted(declared)[0]!r}, which the contract does not know" if declared else None
    if problem:
        raise EngineError(f"{path.name} {problem}; rebuild the engine with `dspark-export build --force`")


@dataclass(frozen=True)
class OrtBackend:
    """ONNX Runtime's settings: `threads` per session (None: every core), execution `providers` (default: the CPU),
    and whether both sessions share the process's thread pool (see the module's docstring)."""

    threads: int | None = None
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    shared_pool: bool = False

    @property
    def thread_count(self) -> int:
        return self.threads or os.cpu_count() or 1

    def open(self, folder: Path, manifest: Manifest) -> tuple[OrtRunner, OrtRunner | None]:
        """(target, drafter) runners of an engine directory (a TensorRT-built one too, said on stderr)."""
        if manifest.backend == "trt":  # its graphs are the portable lowering, which ONNX Runtime runs too
            print(f"{folder.name} was built for TensorRT, which the runtime cannot run yet: running its ONNX graphs on "
                  "ONNX Runtime (slower)", file=sys.stderr)
        providers = list(self.providers)
        if "CUDAExecutionProvider" in providers and "CUDAExecutionProvider" not in available_providers():
            raise MissingDependencyError(
                "CUDA was requested but onnxruntime has no CUDA provider: pip install 'dspark[gpu]'"
            )
        target = OrtRunner(folder / TARGET_GRAPH, manifest.target_io(), self.thread_count, providers, self.shared_pool)
        drafter_io = manifest.drafter_io()
        drafter = drafter_io and OrtRunner(folder / DRAFTER_GRAPH, drafter_io, self.thread_count, providers,
                                           self.shared_pool)
        return target, drafter

    def machine(self) -> dict[str, Any]:
        """What a speed curve depends on besides the engine: the processor, its cores, the threads, the runtime.
        Not the thread pool: the shared one saves each run a wake-up, a small constant the schedule does not turn
        on, so the CLI (shared) and the Python API (per-session) keep one curve."""
        import onnxruntime

        return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": self.thread_count,
                "provider": self.providers[0], "onnxruntime": onnxruntime.__version__}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

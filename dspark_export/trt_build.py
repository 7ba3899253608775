"""TensorRT engines beside the ONNX graphs of an engine directory, built through Polygraphy's API.

The ONNX graphs already carry their precision (TensorRT 11 networks are strongly typed), and their
attention call nodes carry `plugin_namespace`/`plugin_version`, so the parser takes the registered
`DSparkVarlenAttention` plugin instead of inlining the function body. One optimization profile per
graph comes from the graph I/O contract resolved for the manifest: the dimensions set per call range over
what the runtime can send, the cache dimensions are fixed. Status: the profiles are tested against the
real graphs; the engine build itself needs TensorRT and a GPU and has not been run on any machine here.
"""

from __future__ import annotations

from pathlib import Path

from dspark_common.engine_dir import DRAFTER_GRAPH, TARGET_GRAPH, Manifest
from dspark_common.errors import DSparkError, MissingDependencyError
from dspark_common.graph_io import GraphIO

Shape = tuple[int, ...]


def dimension_ranges(manifest: Manifest) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every dimension the contract sets per call. `opt` is one verification step of
    every slot (γ + 1 tokens each), the load the engine is tuned for."""
    tokens, slots = manifest.max_batch_tokens, manifest.cache_slots
    step = min(tokens, slots * (manifest.gamma + 1))
    return {
        "T": (1, step, tokens),  # target: flattened new tokens
        "N": (1, step, tokens),  # target: rows that want logits
        "C": (1, step, tokens),  # drafter: context tokens whose features enter the drafter cache
        "R": (1, slots, slots),  # drafter: requests drafted in one call
    }


def profile_shapes(io: GraphIO, ranges: dict[str, tuple[int, int, int]]) -> dict[str, tuple[Shape, Shape, Shape]]:
    """Input name -> (min, opt, max) shapes, for a contract resolved for an engine (cache sizes fixed)."""
    shapes = {}
    for tensor in io.inputs:
        unknown = [d for d in tensor.shape if isinstance(d, str) and d not in ranges]
        if unknown:
            raise DSparkError(
                f"input {tensor.name!r} has dimension {unknown[0]!r}, which the TensorRT profile does not know"
            )
        shapes[tensor.name] = tuple(
            tuple(d if isinstance(d, int) else ranges[d][i] for d in tensor.shape) for i in range(3)
        )
    return shapes


def require_tensorrt() -> None:
    try:
        import polygraphy  # noqa: F401
        import tensorrt  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "--backend trt needs TensorRT and an NVIDIA GPU: pip install 'dspark[trt]' on a CUDA machine"
        ) from None


def build_trt_engines(folder: Path, manifest: Manifest) -> list[Path]:
    """Build `<graph>.engine` for each ONNX graph in `folder`; returns the engine files."""
    require_tensorrt()
    from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxPath, Profile, SaveEngine

    from dspark_plugins.trt_plugin import register_plugin

    try:
        register_plugin()
    except ImportError as exc:
        raise MissingDependencyError(str(exc)) from None
    ranges = dimension_ranges(manifest)
    engines = []
    for name, io in ((TARGET_GRAPH, manifest.target_io()), (DRAFTER_GRAPH, manifest.drafter_io())):
        if io is None:
            continue
        graph = folder / name
        profile = Profile()
        for input_name, (low, opt, high) in profile_shapes(io, ranges).items():
            profile.add(input_name, low, opt, high)
        network = NetworkFromOnnxPath(str(graph), strongly_typed=True)
        engine = EngineFromNetwork(network, config=CreateConfig(profiles=[profile]))
        engine_file = graph.with_suffix(".engine")
        SaveEngine(engine, str(engine_file))()
        engines.append(engine_file)
    return engines

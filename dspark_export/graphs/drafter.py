"""Build `drafter.onnx` from a drafter's and the target's safetensors: the body its type names in `BODIES`,
declared with that type's contract (`dspark_common.graph_io.DRAFTER_IO`), drafts drawn by inverse CDF from
the `noise` input so the graph is deterministic given its inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from onnx import TensorProto

from dspark_export.checkpoint import Checkpoint
from dspark_export.graphs.block_body import block_body
from dspark_export.graphs.decoder import DecoderOps
from dspark_export.graphs.eagle3_body import eagle3_body
from dspark_export.graphs.model_file import write_model
from dspark_export.graphs.sampler import Sampler
from dspark_export.graphs.weights import ExternalData, Reader, WeightFormat, Weights
from dspark_export.interop import DrafterSource
from dspark_plugins.builder import GraphBuilder
from dspark_common.graph_io import drafter_io

# drafter type (the contract's `DRAFTER_TYPES`) -> the body that builds its graph
BODIES: dict[str, Callable[..., None]] = {"dspark": block_body, "dflash": block_body, "eagle3": eagle3_body}


def build_drafter_onnx(source: DrafterSource, target: Checkpoint, graph_file: str | Path,
                       weights: WeightFormat = WeightFormat(), greedy_shortcut: bool = False,
                       target_graph: Weights | None = None) -> Path:
    """Write the drafter graph (float32 activations) and its external data; returns the graph path.

    Quantized `weights` (int8, int4) store every projection (the layers', the LM head, the Markov output)
    block-quantized: less weight traffic per draft. Drafts change slightly, losslessness does not (the
    distribution a draft was drawn from is what the graph returns). `greedy_shortcut` lets all-greedy calls
    skip the distributions and score the sequential head on candidates only (see `Sampler`); TensorRT's
    conditionals do not allow it, ONNX Runtime does. With `target_graph` (`Weights.lend_from` the target graph
    beside it), the embedding and LM head the drafter shares with the target are that graph's own tensors in
    its format, stored once; without, they are copied.
    """
    config, t = source.config, target.config
    graph_file = Path(graph_file)
    graph_file.parent.mkdir(parents=True, exist_ok=True)
    io = drafter_io(config.drafter_type, config.num_layers, t.num_key_value_heads, t.head_dim,
                    t.hidden_size * len(config.feature_layers), config.gamma, config.confidence)
    store = ExternalData(graph_file)
    shared = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": target.lm_head_name()}
    shared = {ours: theirs for ours, theirs in shared.items() if ours in config.shared_names()}
    stream = Weights(drafter_reader(source, target, shared), store, "float32", weights, strict=False,
                     lender=target_graph, borrowed=shared, coupled_rows=True)
    b = GraphBuilder()
    ops = DecoderOps(b, stream, t.rms_norm_eps, TensorProto.FLOAT, t.head_dim)
    sampler = Sampler(b, config.drafted_vocab, greedy_shortcut, source.target_ids(), t.vocab_size)
    BODIES[config.drafter_type](b, ops, config, sampler, io)
    store.close()
    metadata = {
        "drafter_config": config.to_json(),
        "weights": weights.name,
        "greedy_shortcut": str(int(greedy_shortcut)),
        "layout": source.layout,
    }
    return write_model(graph_file, b, io, list(stream.initializers.values()), "drafter", metadata)


def drafter_reader(source: DrafterSource, target: Checkpoint, shared: dict[str, str]) -> Reader:
    """Tensors by our name: the drafter's own, and the target's for the ones it shares."""
    return lambda name: target.raw(shared[name]) if name in shared else source.read(name)

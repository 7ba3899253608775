"""A built graph becomes a model file: inputs and outputs declared from the graph I/O contract, the varlen
attention function attached, metadata recorded, saved with its external data beside it."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, ValueInfoProto, helper

from dspark_export.graphs.weights import ONNX_DTYPES
from dspark_plugins.builder import GraphBuilder
from dspark_plugins.onnx_function import opset_imports, varlen_attention_function
from dspark_common.engine_dir import FORMAT_VERSION
from dspark_common.graph_io import GraphIO, Tensor
from dspark_common.native import DOMAIN as DSPARK_DOMAIN

ORT_DOMAIN = "com.microsoft"  # ONNX Runtime's fused kernels (MatMulNBits, GroupQueryAttention, ...)


def value_infos(tensors: tuple[Tensor, ...]) -> list[ValueInfoProto]:
    return [helper.make_tensor_value_info(t.name, ONNX_DTYPES[t.dtype], list(t.shape)) for t in tensors]


def write_model(graph_file: Path, b: GraphBuilder, io: GraphIO, initializers: list[TensorProto], kind: str,
                metadata: dict[str, str]) -> Path:
    """Save the nodes of `b` as graph `kind` ("target" or "drafter") with the contract's inputs and outputs."""
    graph = helper.make_graph(b.nodes, f"dspark_{kind}", value_infos(io.inputs), value_infos(io.outputs),
                              initializer=initializers)
    domains = [ORT_DOMAIN] + [DSPARK_DOMAIN] * uses_domain(b.nodes, DSPARK_DOMAIN)
    model = helper.make_model(graph, opset_imports=opset_imports() + [helper.make_opsetid(d, 1) for d in domains],
                              functions=[varlen_attention_function()], producer_name="dspark-export")
    helper.set_model_props(model, {"dspark_graph": kind, "dspark_format": str(FORMAT_VERSION)} | metadata)
    onnx.save_model(model, str(graph_file))
    return graph_file


def uses_domain(nodes: list[onnx.NodeProto], domain: str) -> bool:
    """Whether any node, or any node of their subgraphs (an `If`'s branches), is an operator of `domain`."""
    return any(node.domain == domain or any(uses_domain(attribute.g.node, domain)
                                            for attribute in node.attribute if attribute.type == onnx.AttributeProto.GRAPH)
               for node in nodes)

"""The varlen-verification attention op: contract, numpy reference, ONNX function (GPU kernel and TensorRT plugin to come)."""

from dspark_plugins.contract import DOMAIN, OP_TYPE, PLUGIN_NAMESPACE, PLUGIN_VERSION
from dspark_plugins.onnx_function import opset_imports, varlen_attention_function, varlen_attention_node
from dspark_plugins.reference import varlen_attention

__all__ = [
    "DOMAIN",
    "OP_TYPE",
    "PLUGIN_NAMESPACE",
    "PLUGIN_VERSION",
    "opset_imports",
    "varlen_attention",
    "varlen_attention_function",
    "varlen_attention_node",
]

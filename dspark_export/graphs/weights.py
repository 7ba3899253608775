"""Weights into a graph: streamed one tensor at a time into an ONNX external-data file (an 8B checkpoint never
sits whole in memory), and `Weights.linear`, the one place every projection of every graph is emitted, in
the engine's weight format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from onnx import TensorProto

from dspark_export.checkpoint import as_float32
from dspark_plugins.builder import GraphBuilder

ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
               "int8": TensorProto.INT8, "uint8": TensorProto.UINT8, "int64": TensorProto.INT64}
ALIGN = 64
WEIGHT_FORMATS = ("float", "int8")  # float: the graph's dtype; int8: per-output-channel int8, dynamically quantized input
Reader = Callable[[str], tuple[np.ndarray, str]]  # tensor name -> (stored array, its dtype; bfloat16 as uint16 bits)


def convert(array: np.ndarray, stored: str, dtype: str) -> np.ndarray:
    """A checkpoint tensor (bfloat16 as uint16 bits) in the graph's dtype (bfloat16 again as uint16 bits)."""
    if dtype == stored:
        return np.ascontiguousarray(array)
    wide = as_float32(array, stored)
    if dtype == "float32":
        return wide
    if dtype == "float16":
        return wide.astype(np.float16)
    bits = wide.view(np.uint32)  # round to nearest even
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


class ExternalData:
    """Appends tensors to `{graph}.data` beside the graph file and builds the referencing TensorProtos."""

    def __init__(self, graph_file: Path):
        self.location = graph_file.name + ".data"
        self.path = graph_file.with_name(self.location)
        self.handle = self.path.open("wb")
        self.offset = 0

    def add(self, name: str, array: np.ndarray, dtype: str) -> TensorProto:
        padding = (-self.offset) % ALIGN
        self.handle.write(b"\0" * padding)
        self.offset += padding
        data = array.tobytes()
        self.handle.write(data)
        tensor = TensorProto(name=name, data_type=ONNX_DTYPES[dtype], dims=array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(self.offset)), ("length", str(len(data)))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.offset += len(data)
        return tensor

    def close(self) -> None:
        self.handle.close()


class Weights:
    """`weights(name)` streams a tensor into the external data on first use, in the graph's dtype, and returns
    its initializer name; `linear` projects with a [out, in] weight in the weight format."""

    def __init__(self, read: Reader, store: ExternalData, dtype: str, weight_format: str = "float",
                 progress: Callable[[int], None] | None = None):
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {weight_format!r}")
        self.read, self.store, self.dtype, self.format, self.progress = read, store, dtype, weight_format, progress
        self.initializers: dict[str, TensorProto] = {}

    def _add(self, name: str, array: np.ndarray, dtype: str) -> str:
        self.initializers[name] = self.store.add(name, np.ascontiguousarray(array), dtype)
        return name

    def __call__(self, name: str) -> str:
        if name not in self.initializers:
            self._add(name, convert(*self.read(name), self.dtype), self.dtype)
            if self.progress:
                self.progress(1)
        return name

    def linear(self, b: GraphBuilder, x: str, name: str, bias: str | None = None) -> str:
        """x [N, in] @ W[out, in]^T (+ the tensor `bias` [out]) -> [N, out]."""
        if self.format == "float":
            return b.op("Gemm", x, self(name), *([self(bias)] if bias else []), transB=1)
        quantized, scale, zero = name + ".int8", name + ".scale", name + ".zero_point"
        if quantized not in self.initializers:
            columns = as_float32(*self.read(name)).T  # [in, out]
            step = np.maximum(np.abs(columns).max(0), 1e-12) / 127.0
            self._add(quantized, np.round(columns / step).astype(np.int8), "int8")
            self._add(scale, step.astype(np.float32), "float32")
            self._add(zero, np.zeros(columns.shape[1], np.int8), "int8")
            if self.progress:
                self.progress(1)
        x_q, x_scale, x_zero = b.op("DynamicQuantizeLinear", x, outputs=3)
        product = b.op("Cast", b.op("MatMulInteger", x_q, quantized, x_zero, zero), to=TensorProto.FLOAT)
        out = b.op("Mul", b.op("Mul", product, x_scale), scale)
        return b.op("Add", out, self(bias)) if bias else out

"""Stream weights into an ONNX external-data file, one tensor at a time (an 8B checkpoint never sits
whole in memory): each tensor is appended to the `.data` file and referenced by offset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto

from dspark_export.checkpoint import as_float32

ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16,
               "int8": TensorProto.INT8}
ALIGN = 64


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

"""A small helper for writing ONNX nodes as expressions: `b.op("MatMul", x, w)` returns the output name."""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import AttributeProto, NodeProto, helper, numpy_helper


class GraphBuilder:
    """Collects nodes with generated, readable value names."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self.nodes: list[NodeProto] = []
        self._count = 0

    def name(self, hint: str) -> str:
        """A fresh value name."""
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, name: str | None = None, outputs: int = 1, domain: str = "",
           names: list[str] | None = None, **attributes: Any) -> str | list[str]:
        """Append a node; returns its output name, or its names when it has several. `name` fixes the name of a
        single output, `names` those of several."""
        if names is None:
            names = [name] if name and outputs == 1 else [self.name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, domain=domain or None, **attributes))
        return names[0] if len(names) == 1 else names

    def const(self, value: Any, dtype: type = np.int64, name: str | None = None) -> str:
        """A Constant node holding `value` (a scalar stays a scalar)."""
        array = np.asarray(value, dtype=dtype)
        output = name or self.name("const")
        self.nodes.append(helper.make_node("Constant", [], [output], value=numpy_helper.from_array(array, output)))
        return output

    def attribute_const(self, attribute: str, kind: str) -> str:
        """A Constant taking its value from the enclosing function's attribute (`kind`: "int" or "float")."""
        output = self.name(attribute)
        node = helper.make_node("Constant", [], [output])
        attr_type = AttributeProto.INT if kind == "int" else AttributeProto.FLOAT
        node.attribute.append(helper.make_attribute_ref(f"value_{kind}", attr_type))
        node.attribute[-1].ref_attr_name = attribute
        self.nodes.append(node)
        return output

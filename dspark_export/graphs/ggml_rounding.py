"""llama.cpp's rounding of the activations a K-quant matrix multiplies, as graph nodes.

ggml computes a Q6_K (or any K-quant) product against activations rounded to Q8_K first (`quantize_row_q8_K`):
per block of 256, the element of largest magnitude `peak` (the first, if several) sets the scale, every element
becomes round-half-even(x · -127/peak) capped at 127, worth code / (-127/peak). A GGUF engine that carries a file's
Q6_K blocks rounds the activations alike, so that it computes what llama.cpp computes on that file (its Q4_0 and
Q8_0 products round to Q8_0, 8 bits per 32 with a float16 scale, which ONNX Runtime's int8 path already all but
repeats by itself).
"""

from __future__ import annotations

import numpy as np

from dspark_plugins.builder import GraphBuilder

Q8_K_BLOCK = 256
Q8_K_CODES = 127.0


def q8_k_rounding(b: GraphBuilder, x: str) -> str:
    """float32 x [.., K] (K a multiple of 256) rounded as ggml's Q8_K holds it; a block of zeros stays zero."""
    blocks = b.op("Reshape", x, b.const([-1, Q8_K_BLOCK]))
    peak = b.op("GatherElements", blocks, b.op("ArgMax", b.op("Abs", blocks), axis=1, keepdims=1), axis=1)
    zero = b.op("Equal", peak, b.const(0.0, np.float32))
    inverse = b.op("Div", b.const(-Q8_K_CODES, np.float32), b.op("Where", zero, b.const(1.0, np.float32), peak))
    codes = b.op("Min", b.op("Round", b.op("Mul", blocks, inverse)), b.const(Q8_K_CODES, np.float32))
    values = b.op("Mul", codes, b.op("Div", b.const(1.0, np.float32), inverse))
    return b.op("Reshape", values, b.op("Shape", x))

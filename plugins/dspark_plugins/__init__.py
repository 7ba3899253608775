"""The varlen-verification attention op `DSparkVarlenAttention`, one module a form:

- `contract`: inputs, attributes and the masking rule, in one place;
- `reference`: the numpy reference;
- `onnx_function`: the ONNX model-local function (standard-op body) and its call node;
- `triton_varlen`: the GPU kernel (Triton), callable from torch;
- `trt_plugin`: the TensorRT plugin around the kernel.

Nothing is imported here, so each form loads only what it needs (the GPU check needs no onnx).
"""

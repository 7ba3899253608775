"""The varlen-verification attention op: contract, ONNX function, GPU kernel, TensorRT plugin."""

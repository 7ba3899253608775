"""ONNX graphs built straight from safetensors weights (onnx + numpy, no torch), one module a job:

- `weights`: streaming tensors into external data; `Weights.linear`, every projection in the weight format;
- `decoder`: the Qwen3 decoder ops (RMSNorm, RoPE, q/k-norm heads, SwiGLU) on flattened tokens;
- `model_file`: a built graph declared from the I/O contract (`dspark_common.graph_io`) and saved;
- `target`: `target.onnx`;
- `drafter`: `drafter.onnx`, with the drafter bodies chosen from a table: `block_body` (DSpark, DFlash) and
  `eagle3_body`, which draw their drafts with `sampler`.
"""

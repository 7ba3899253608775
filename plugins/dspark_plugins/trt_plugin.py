"""The TensorRT plugin for `DSparkVarlenAttention`: the Triton kernel behind TensorRT's quickly deployable
plugin API (`tensorrt.plugin`, TensorRT >= 10.7), under the namespace and version the ONNX call nodes carry.

`register_plugin()` must run before an ONNX file is parsed or an engine deserialised; the exporter's
TensorRT path calls it (the runtime has no TensorRT backend yet). Nothing here is imported until then,
so a machine without TensorRT, CUDA or Triton never loads it. Status: written against the documented
API and checked on CPU through its torch-side launcher only; no TensorRT was available to run it end
to end. An ahead-of-time (`aot_impl`) variant, which would drop the Python dependency at run time, is
not written.
"""

from __future__ import annotations

from dspark_plugins.contract import OP_TYPE, PLUGIN_NAMESPACE

PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{OP_TYPE}"
_registered = False


def launch(tensors, bidirectional: int, scale: float, out) -> None:
    """Run the kernel on the eight input tensors (contract order) into `out`, all torch tensors."""
    from dspark_plugins.triton_varlen import varlen_attention

    out.copy_(varlen_attention(*tensors, bidirectional=bool(bidirectional), scale=scale or None))


def register_plugin() -> None:
    """Register the plugin with TensorRT's registry (idempotent)."""
    global _registered
    if _registered:
        return
    try:
        import tensorrt.plugin as trtp
        import torch
    except ImportError as exc:
        from dspark_common.errors import MissingDependencyError

        raise MissingDependencyError(
            f"the {PLUGIN_ID} TensorRT plugin needs TensorRT >= 10.7, torch and Triton on a CUDA machine "
            f"(pip install 'dspark[trt]'): {exc}"
        ) from None

    @trtp.register(PLUGIN_ID)
    def describe(q: trtp.TensorDesc, k_new: trtp.TensorDesc, v_new: trtp.TensorDesc, k_cache: trtp.TensorDesc,
                 v_cache: trtp.TensorDesc, slot: trtp.TensorDesc, pos: trtp.TensorDesc, cache_len: trtp.TensorDesc,
                 bidirectional: int, scale: float) -> trtp.TensorDesc:
        return q.like()

    @trtp.impl(PLUGIN_ID)
    def run(q: trtp.Tensor, k_new: trtp.Tensor, v_new: trtp.Tensor, k_cache: trtp.Tensor, v_cache: trtp.Tensor,
            slot: trtp.Tensor, pos: trtp.Tensor, cache_len: trtp.Tensor, bidirectional: int, scale: float,
            outputs: tuple, stream: int) -> None:
        tensors = [torch.as_tensor(t, device="cuda") for t in (q, k_new, v_new, k_cache, v_cache, slot, pos, cache_len)]
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            launch(tensors, bidirectional, scale, torch.as_tensor(outputs[0], device="cuda"))

    _registered = True

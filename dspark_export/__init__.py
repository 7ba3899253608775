"""DSpark exporter: Qwen3 targets and drafters in torch, ONNX graph building, the `dspark-export` CLI."""

from dspark_export.checkpoint import Checkpoint
from dspark_export.config import DecoderConfig
from dspark_export.presets import KNOWN_TARGETS, TargetSpec, resolve_target

__all__ = ["Checkpoint", "KNOWN_TARGETS", "DecoderConfig", "TargetSpec", "resolve_target"]

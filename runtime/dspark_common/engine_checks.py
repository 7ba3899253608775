"""The checks an engine directory's JSON files pass before anything in them is used: `manifest.json` against
its schema (types, ranges, files inside the directory, a vocabulary and context the model has), and the side
files `hardware_curve.json` and `calibration.json` that profiling and calibration write. Each failure is one
`EngineError` line saying what to redo, never a traceback or a hang."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable

from dspark_common.errors import EngineError
from dspark_common.graph_io import ACTIVATION_DTYPES, DRAFTER_TYPES, IN_PLACE_ATTENTION

WEIGHT_FORMATS = ("fp32", "fp16", "bf16", "int8", "int4", "w8a8", "w4a8")  # how an engine stores its weights
INT4_ROWS = "w4a8"  # the format whose graphs use DSpark's own operators (dspark_common.native)
ENGINE_BACKENDS = ("ort", "trt")  # what an engine is built for: ONNX Runtime, TensorRT
REBUILD = "rebuild the engine with `dspark-export build --force`"
FILE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _integer(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _number(value: Any, low: float = 0.0, strict: bool = True) -> bool:
    """A finite int or float above `low` (or at least `low` when not `strict`)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return value > low if strict else value >= low


def _one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda value: value in choices


MANIFEST_FIELDS: dict[str, Callable[[Any], bool]] = {
    "target": lambda v: isinstance(v, dict),
    "target_name": lambda v: isinstance(v, str),
    "drafter": lambda v: v is None or isinstance(v, dict),
    "drafter_name": lambda v: v is None or isinstance(v, str),
    "dtype": _one_of(*ACTIVATION_DTYPES),
    "backend": _one_of(*ENGINE_BACKENDS),
    "cache_slots": lambda v: _integer(v, 1),
    "max_context": lambda v: _integer(v, 2),
    "max_batch_tokens": lambda v: _integer(v, 1),
    "vocab_size": lambda v: _integer(v, 1),
    "eos_token_ids": lambda v: isinstance(v, list) and all(_integer(t) for t in v),
    "feature_layers": lambda v: isinstance(v, list) and all(_integer(t) for t in v),
    "weights": _one_of(*WEIGHT_FORMATS),
    "drafter_weights": lambda v: v is None or v in WEIGHT_FORMATS,
    "attention": _one_of("varlen", *IN_PLACE_ATTENTION),
    "files": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(d, str) for k, d in v.items()),
    "sources": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(d, str) for k, d in v.items()),
    "format_version": lambda v: _integer(v),
}
TARGET_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim",
                 "max_position_embeddings")
DRAFTER_FIELDS: dict[str, Callable[[Any], bool]] = {
    "drafter_type": _one_of(*DRAFTER_TYPES), "gamma": lambda v: _integer(v, 1), "num_layers": lambda v: _integer(v, 1),
    "confidence": lambda v: isinstance(v, bool),
}


def check_manifest(raw: Any, folder: Path) -> dict[str, Any]:
    """The manifest's fields, once every one has the right type and range and they agree with each other."""
    def fail(problem: str) -> None:
        raise EngineError(f"{folder / 'manifest.json'} is corrupt ({problem}); {REBUILD}")

    if not isinstance(raw, dict):
        fail("not a JSON object")
    for name, valid in MANIFEST_FIELDS.items():
        if name not in raw:
            fail(f"no {name!r}")
        if not valid(raw[name]):
            shown = repr(raw[name])
            fail(f"{name!r} is {shown if len(shown) <= 60 else shown[:57] + '...'}")
    unknown = sorted(set(raw) - set(MANIFEST_FIELDS))
    if unknown:
        fail(f"unknown field {unknown[0]!r}")
    target = raw["target"]
    for name in TARGET_FIELDS:
        if not _integer(target.get(name), 1):
            fail(f"the target's {name!r} is {target.get(name)!r}")
    if raw["vocab_size"] != target["vocab_size"]:
        fail(f"vocab_size {raw['vocab_size']} is not the target's {target['vocab_size']}")
    if raw["max_context"] > target["max_position_embeddings"]:
        fail(f"max_context {raw['max_context']} exceeds the model's {target['max_position_embeddings']} positions")
    if any(not -1 <= layer < target["num_hidden_layers"] for layer in raw["feature_layers"]):
        fail(f"feature_layers {raw['feature_layers']} lie outside the target's layers")
    if any(token >= raw["vocab_size"] for token in raw["eos_token_ids"]):
        fail("an end-of-text id lies outside the vocabulary")
    if raw["drafter"] is not None:
        for name, valid in DRAFTER_FIELDS.items():
            if not valid(raw["drafter"].get(name)):
                fail(f"the drafter's {name!r} is {raw['drafter'].get(name)!r}")
    for name in raw["files"]:
        if not FILE_NAME.match(name) or name in (".", ".."):
            fail(f"the file entry {name[:60]!r} is not a file name inside the directory")
    return raw


def check_speed_curve(data: Any, folder: Path, cache_slots: int, has_drafter: bool) -> dict:
    """hardware_curve.json's tables: finite seconds (positive for the target), a drafter entry per slot when there
    is a drafter."""
    def valid() -> bool:
        if not isinstance(data, dict) or not isinstance(data.get("target_seconds"), list) or not data["target_seconds"]:
            return False
        draft = data.get("draft_seconds", [])
        if not isinstance(draft, list) or (has_drafter and len(draft) < cache_slots):
            return False
        per_row = data.get("draft_seconds_per_context_row", 0.0)
        return (all(_number(t) for t in data["target_seconds"]) and all(_number(t, strict=False) for t in draft)
                and _number(per_row, strict=False))

    if not valid():
        raise EngineError(f"{folder / 'hardware_curve.json'} is corrupt; measure it again with `dspark-run profile`")
    return data


def check_calibration(data: Any, folder: Path, gamma: int) -> dict[float, dict]:
    """calibration.json's reports by sampling temperature, each with γ positive temperatures (and offsets)."""
    def fail() -> None:
        raise EngineError(f"{folder / 'calibration.json'} is corrupt; fit it again with `dspark-run calibrate` "
                          "(or delete it)")

    if not isinstance(data, dict):
        fail()
    reports = data["by_temperature"] if "by_temperature" in data else {data.get("temperature", 1.0): data}
    if not isinstance(reports, dict) or not reports:
        fail()
    out = {}
    for key, report in reports.items():
        try:
            temperature = float(key)
        except (TypeError, ValueError):
            fail()
        if not isinstance(report, dict) or not math.isfinite(temperature) or temperature < 0:
            fail()
        scales, offsets = report.get("temperatures"), report.get("biases", [0.0] * gamma)
        if not (isinstance(scales, list) and len(scales) == gamma and all(_number(t) for t in scales)):
            fail()
        if not (isinstance(offsets, list) and len(offsets) == gamma and all(_number(b, -math.inf) for b in offsets)):
            fail()
        out[temperature] = report
    return out

"""The engine directory: its file names and `manifest.json` schema, defined once here (the exporter
writes it through this module, the runtime reads it). A manifest lists every file with its SHA-256,
so a directory whose files changed after the build is refused with a message saying what to rebuild.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dspark_common.engine_checks import REBUILD, check_calibration, check_manifest, check_speed_curve
from dspark_common.errors import EngineError, read_json_file
from dspark_common.graph_io import IN_PLACE_ATTENTION, GraphIO, drafter_io, target_io

FORMAT_VERSION = 5  # bumped whenever the exporter writes different graphs or manifests: older engines are rebuilt
# 3: the graph I/O contract (`graph_io`), γ named `gamma`, the attention op's `bidirectional` attribute
MANIFEST = "manifest.json"
TARGET_GRAPH = "target.onnx"
DRAFTER_GRAPH = "drafter.onnx"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
HARDWARE_CURVE = "hardware_curve.json"  # written by profiling, not hashed
CALIBRATION = "calibration.json"  # written by calibration, not hashed


@dataclass(frozen=True)
class Manifest:
    target: dict[str, Any]  # the target's Hugging Face config (config.json)
    target_name: str
    drafter: dict[str, Any] | None  # the drafter's config.json, None for a target-only engine
    drafter_name: str | None
    dtype: str
    backend: str  # "ort" | "trt"
    cache_slots: int  # S: concurrent requests
    max_context: int  # tokens of context a request may use (prompt and output)
    max_batch_tokens: int  # most tokens in one target step
    vocab_size: int
    eos_token_ids: list[int]
    feature_layers: list[int]
    weights: str = "fp32"  # the target's weight format: fp32 | fp16 | bf16 | int8 | int4
    drafter_weights: str | None = None  # the drafter's
    attention: str = "varlen"  # the target's: "varlen" (the portable op), or one of IN_PLACE_ATTENTION
    files: dict[str, str] = field(default_factory=dict)  # name -> sha256
    sources: dict[str, str] = field(default_factory=dict)  # weights digests ("target", "drafter")
    format_version: int = FORMAT_VERSION

    @property
    def gamma(self) -> int:
        """γ: draft tokens per round (0 for a target-only engine)."""
        return int(self.drafter["gamma"]) if self.drafter else 0

    @property
    def cache_rows(self) -> int:
        """Positions each cache slot holds: the context, and room for one step's drafts beyond its end (an in-place
        graph pads every slot's new tokens to the step's longest)."""
        return self.max_context + self.gamma + 1

    def target_io(self) -> GraphIO:
        t = self.target
        return target_io(t["num_hidden_layers"], t["num_key_value_heads"], t["head_dim"], self.vocab_size,
                         t["hidden_size"] * len(self.feature_layers), self.dtype, self.attention in IN_PLACE_ATTENTION,
                         self.cache_slots, self.cache_rows)

    def drafter_io(self) -> GraphIO | None:
        if not self.drafter:
            return None
        t, d = self.target, self.drafter
        return drafter_io(d["drafter_type"], d["num_layers"], t["num_key_value_heads"], t["head_dim"],
                          t["hidden_size"] * len(self.feature_layers), self.gamma, bool(d["confidence"]),
                          self.cache_slots, self.cache_rows)


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def weights_digest(folder: Path) -> str:
    """One SHA-256 over a checkpoint folder's `*.safetensors` and `*.gguf` files (in name order)."""
    digest = hashlib.sha256()
    for path in sorted([*Path(folder).glob("*.safetensors"), *Path(folder).glob("*.gguf")]):
        digest.update(path.name.encode() + file_digest(path).encode())
    return digest.hexdigest()


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Hash every file already in `folder` into the manifest and write it (last, so a half-built folder has none)."""
    files = {p.name: file_digest(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    payload = asdict(manifest) | {"files": files}
    (folder / MANIFEST).write_text(json.dumps(payload, indent=2) + "\n")


def read_manifest(folder: str | Path, verify: bool = True) -> Manifest:
    """Read and (by default) verify an engine directory; errors say what to rebuild."""
    folder = Path(folder)
    file = folder / MANIFEST
    if not file.is_file():
        raise EngineError(
            f"{folder} is not a DSpark engine directory (no {MANIFEST}); build one with `dspark-export build`"
        )
    raw = read_json_file(file, EngineError, REBUILD)
    if raw.get("format_version") != FORMAT_VERSION:
        raise EngineError(
            f"{folder} has engine format {raw.get('format_version')!r}, this DSpark reads {FORMAT_VERSION}; rebuild it"
        )
    manifest = Manifest(**check_manifest(raw, folder))
    if verify:
        for name, expected in manifest.files.items():
            path = folder / name
            if not path.is_file():
                raise EngineError(f"{folder} lacks {name}; rebuild the engine with `dspark-export build --force`")
            if file_digest(path) != expected:
                raise EngineError(
                    f"{name} in {folder} changed after the build; rebuild the engine with `dspark-export build --force`"
                )
    return manifest


def read_speed_curve(folder: Path, manifest: Manifest) -> dict | None:
    """hardware_curve.json (None before profiling), checked."""
    file = folder / HARDWARE_CURVE
    if not file.is_file():
        return None
    data = read_json_file(file, EngineError, "measure it again with `dspark-run profile`")
    return check_speed_curve(data, folder, manifest.cache_slots, manifest.drafter is not None)


def read_calibration(folder: Path, gamma: int) -> dict[float, dict]:
    """calibration.json's reports by sampling temperature ({} without one); a file from before per-temperature
    calibration holds one report at its top level."""
    file = folder / CALIBRATION
    if not file.is_file():
        return {}
    data = read_json_file(file, EngineError, "fit it again with `dspark-run calibrate`")
    return check_calibration(data, folder, gamma)


def sts_by_temperature(reports: dict[float, dict]) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """(STS temperatures, offsets) per sampling temperature, from calibration reports."""
    return {t: (np.asarray(r["temperatures"]), np.asarray(r.get("biases", np.zeros(len(r["temperatures"])))))
            for t, r in reports.items()}

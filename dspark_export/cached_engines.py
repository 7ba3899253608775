"""Engines built on first use into the user cache (no network, no torch): the bundled demo's, and one for a model
file named on the command line (`dspark-run FILE.gguf`, `dspark-run ollama:qwen3:8b`), as llama.cpp runs a file.
Each is rebuilt when its sources or the exporter changed, and reused otherwise."""

from __future__ import annotations

import sys
from pathlib import Path
from collections.abc import Callable

from dspark_common.engine_dir import MANIFEST, read_manifest
from dspark_common.errors import CheckpointError, ConfigError, EngineError


def demo_engine() -> Path:
    """The folder of the demo's engine (demo target, demo-dspark drafter), built first when missing or stale, which
    a line on stderr announces."""
    from dspark_export.build import build_engine, default_engine_dir, source_digests
    from dspark_export.drafters.bundled import bundled_root, default_drafter
    from dspark_export.presets import demo_dir, resolve_target

    drafter = default_drafter("demo")
    drafter_dir = bundled_root() / drafter if drafter else None
    folder = default_engine_dir("demo", drafter)
    if not _built_from(folder, lambda: source_digests(demo_dir(), drafter_dir)):
        print(f"building the demo engine into {folder} (first use; seconds)...", file=sys.stderr)
        build_engine(resolve_target("demo"), folder, drafter_dir, drafter, force=True, show_progress=False)
    return folder


def model_engine(model: str | None, drafter: str | None = None) -> Path:
    """The folder of the engine of `model` (a GGUF file, a store name such as ollama:NAME, a Hugging Face model
    folder, or None: the demo) with `drafter` (default: a bundled drafter trained for this target, else none: plain
    decoding), built on first use with a GGUF file's own weights or, for a Hugging Face folder, the format
    `--weights auto` measures fastest here, which lines on stderr announce."""
    from dspark_export.build import build_engine, default_engine_dir, source_digests
    from dspark_export.drafters.bundled import matching_drafter, resolve_drafter
    from dspark_export.graphs.weights import WeightFormat
    from dspark_export.presets import resolve_target
    from dspark_export.sizing import DESKTOP_SLOTS

    spec = resolve_target(None, _model_reference(model)) if model else resolve_target("demo")
    drafter = drafter or matching_drafter(spec)
    drafter_dir = resolve_drafter(drafter) if drafter else None
    folder = default_engine_dir(spec.name, drafter and (drafter if drafter.startswith("demo-") else drafter_dir.name))
    changed = _last_change(spec.searched[0])
    if not _built_from(folder, lambda: source_digests(spec.require_path(), drafter_dir), changed):
        with_drafter = f"drafter {drafter}" if drafter else \
            "no drafter fits this target, so plain decoding (name one with --drafter)"
        print(f"building an engine of {model} into {folder} (first use; {with_drafter})...", file=sys.stderr)
        try:
            weights = spec.weights and WeightFormat(spec.weights)  # the file's own (Q4_0 -> int4...); else auto
            build_engine(spec, folder, drafter_dir, drafter, force=True, weights=weights, cache_slots=DESKTOP_SLOTS,
                         show_progress=sys.stderr.isatty())
        except ConfigError as exc:
            raise ConfigError(f"{exc} (drafter {drafter})") from None
    return folder


def _model_reference(model: str) -> str:
    """`model` when it names a model file, folder or store entry; else an error naming what was looked for."""
    from dspark_export.model_stores import is_store_reference

    path = Path(model).expanduser()
    if is_store_reference(model) or path.is_file() or (path / "config.json").is_file():
        return model
    what = "is neither a DSpark engine (no manifest.json) nor a Hugging Face model folder (no config.json)" \
        if path.is_dir() else "does not exist"
    raise CheckpointError(f"{model} {what}; give an engine folder, a GGUF file or a model folder, or build an engine "
                          "with `dspark-export build --target-path MODEL --out DIR`")


def _last_change(weights: Path) -> float:
    """When a weights file, or the newest file of a weights folder, last changed."""
    weights = Path(weights)
    return max((p.stat().st_mtime for p in weights.iterdir() if p.is_file()), default=0.0) if weights.is_dir() \
        else weights.stat().st_mtime


def _built_from(folder: Path, digests: Callable[[], dict[str, str]], changed: float | None = None) -> bool:
    """Whether `folder` holds an engine of the current format built from the sources `digests()` names. Hashing
    large weights takes seconds, so given when they last `changed`, they are hashed only if that was after the
    engine was written."""
    try:
        manifest = read_manifest(folder, verify=False)
    except EngineError:  # never built, damaged, or written by an exporter an upgrade has since replaced
        return False
    if changed is not None and changed < (folder / MANIFEST).stat().st_mtime:
        return True
    return manifest.sources == digests()

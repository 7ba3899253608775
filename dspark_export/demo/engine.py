"""The bundled demo's engine, built into the user cache on first use (no network, no torch) and rebuilt when an
upgrade replaced its weights, its drafter or the exporter's graphs."""

from __future__ import annotations

import sys
from pathlib import Path

from dspark_common.engine_dir import read_manifest
from dspark_common.errors import EngineError


def demo_engine() -> Path:
    """The folder of the demo's engine (demo target, demo-dspark drafter), built first when missing or stale, which
    a line on stderr announces."""
    from dspark_export.build import build_engine, default_engine_dir, source_digests
    from dspark_export.drafters.bundled import bundled_root, default_drafter
    from dspark_export.presets import demo_dir, resolve_target

    drafter = default_drafter("demo")
    drafter_dir = bundled_root() / drafter if drafter else None
    folder = default_engine_dir("demo", drafter)
    try:
        current = read_manifest(folder).sources == source_digests(demo_dir(), drafter_dir)
    except EngineError:
        current = False
    if not current:  # never built, damaged, or built from weights or by an exporter an upgrade has since replaced
        print(f"building the demo engine into {folder} (first use; seconds)...", file=sys.stderr)
        build_engine(resolve_target("demo"), folder, drafter_dir, drafter, force=True, show_progress=False)
    return folder

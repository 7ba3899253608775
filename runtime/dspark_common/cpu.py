"""What the processor offers that decides how int8 products may be laid out."""

from __future__ import annotations

import platform
from pathlib import Path

EXACT_INT8_DOTS = ("avx512_vnni", "avx_vnni", "amx_int8")  # x86 extensions that sum u8 x s8 products in int32


def cpu_flags() -> set[str]:
    """The processor's feature flags as Linux lists them (empty where /proc/cpuinfo is not there)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))


def int8_code_max() -> int:
    """The largest int8 weight code whose products ONNX Runtime sums exactly on this CPU: 127, or 63 on x86 without
    VNNI or AMX, where its u8 x s8 kernel adds pairs of products in int16 (`vpmaddubsw`) and 8-bit weights can
    saturate them (255 · 63 · 2 < 2^15), as ONNX Runtime's own quantizer's `reduce_range` does."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return 127  # Arm's int8 dot products accumulate in int32
    return 127 if cpu_flags() & set(EXACT_INT8_DOTS) else 63

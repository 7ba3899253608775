"""DSpark's own ONNX Runtime operators (the `ai.dspark` domain: `native/int4_rows.c` for `w4a8` engines,
`native/k_quants.c` for GGUF files' K-quant matrices, `native/attention.c` for those targets' and drafters'
attention), compiled once per source and compiler with the system's C compiler (`$CC`, else `cc`) into the user's
cache, and registered with a session by `SessionOptions.register_custom_ops_library` wherever a graph imports the
domain."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from dspark_common.errors import MissingDependencyError

SOURCES = Path(__file__).with_name("native")
DOMAIN = "ai.dspark"
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC", "-fvisibility=hidden")


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def usable() -> bool:
    """Whether this machine can build the operators: an x86-64 CPU and a C compiler."""
    return _x86() and _compiler() is not None


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value, shift, at = value | (byte & 0x7F) << shift, shift + 7, at + 1
        if byte < 0x80:
            return value, at


def _fields(data: bytes) -> Iterator[tuple[int, bytes | None]]:
    """A protobuf message's top-level fields: (number, bytes of a length-delimited one, else None)."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        kind = key & 7
        if kind == 0:
            _, at = _varint(data, at)
        elif kind == 2:
            length, at = _varint(data, at)
            yield key >> 3, data[at : at + length]
            at += length
            continue
        else:  # fixed 64 or 32 bits
            at += 8 if kind == 1 else 4
        yield key >> 3, None


def uses_operators(graph_file: Path) -> bool:
    """Whether a graph imports the `ai.dspark` domain: ModelProto's opset_import (field 8) read from the file's
    top-level fields (importing onnx would add a second to every engine load)."""
    domain = DOMAIN.encode()
    return any(number == 8 and value is not None and (1, domain) in _fields(value)
               for number, value in _fields(Path(graph_file).read_bytes()))


def operators_library() -> Path:
    """The compiled library, built here on first use; a clear error where this machine cannot build or run it."""
    if not _x86():
        raise MissingDependencyError(f"DSpark's operators need an x86-64 CPU with AVX2 (this is {platform.machine()})")
    compiler = _compiler()
    if compiler is None:
        raise MissingDependencyError("this engine's ONNX Runtime operators are compiled once with a C compiler; "
                                     "none was found (install gcc, or set CC)")
    sources = sorted(SOURCES.glob("*.c"))
    text = b"".join(path.read_bytes() for path in [*sources, *sorted(SOURCES.glob("*.h"))])
    digest = hashlib.sha256(text + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dspark"
    library = cache / f"operators-{digest}.so"
    if library.is_file():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / library.name
        result = subprocess.run([compiler, *FLAGS, *map(str, sources), "-o", str(built)], capture_output=True,
                                text=True)
        if result.returncode:
            raise MissingDependencyError(f"{compiler} could not build DSpark's operators: {result.stderr[-500:]}")
        built.replace(library)  # atomic: a concurrent first use finds a whole file or none
    return library

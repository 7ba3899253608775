"""DSpark's own ONNX Runtime operators (the `ai.dspark` domain: `native/int4_rows.c` for `w4a8` engines,
`native/k_quants.c` for GGUF files' K-quant matrices), compiled once per source and compiler with the system's C
compiler (`$CC`, else `cc`) into the user's cache, and registered with a session by
`SessionOptions.register_custom_ops_library` wherever a graph imports the domain."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from dspark_common.errors import MissingDependencyError

SOURCES = Path(__file__).with_name("native")
DOMAIN = "ai.dspark"
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC", "-fvisibility=hidden")


def usable() -> bool:
    """Whether this machine can build the operators: an x86-64 CPU and a C compiler."""
    return platform.machine().lower() in ("x86_64", "amd64") and shutil.which(os.environ.get("CC", "cc")) is not None


def uses_operators(graph_file: Path) -> bool:
    """Whether a graph imports the `ai.dspark` domain (read without its weights)."""
    import onnx

    return any(entry.domain == DOMAIN for entry in onnx.load(str(graph_file), load_external_data=False).opset_import)


def operators_library() -> Path:
    """The compiled library, built here on first use; a clear error where this machine cannot build or run it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise MissingDependencyError(f"DSpark's operators need an x86-64 CPU with AVX2 (this is {platform.machine()})")
    compiler = shutil.which(os.environ.get("CC", "cc"))
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

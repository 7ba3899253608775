"""DSpark's own ONNX Runtime operators (`native/int4_rows.c`: the `ai.dspark` domain of `w4a8` engines), compiled
once per source and compiler with the system's C compiler (`$CC`, else `cc`) into the user's cache, and registered
with a session by `SessionOptions.register_custom_ops_library`."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from dspark_common.errors import MissingDependencyError

SOURCE = Path(__file__).with_name("native") / "int4_rows.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC", "-fvisibility=hidden")


def operators_library() -> Path:
    """The compiled library, built here on first use; a clear error where this machine cannot build or run it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise MissingDependencyError(f"w4a8 engines need an x86-64 CPU with AVX2 (this is {platform.machine()})")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise MissingDependencyError("w4a8 engines compile their ONNX Runtime operators once with a C compiler; "
                                     "none was found (install gcc, or set CC)")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dspark"
    library = cache / f"int4_rows-{digest}.so"
    if library.is_file():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / library.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
        if result.returncode:
            raise MissingDependencyError(f"{compiler} could not build the w4a8 operators: {result.stderr[-500:]}")
        built.replace(library)  # atomic: a concurrent first use finds a whole file or none
    return library

"""Folders that appear only when complete: an interrupted write (a full disk, Ctrl+C) never leaves one that
looks valid."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it replaces `out`, on any error it is removed."""
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise

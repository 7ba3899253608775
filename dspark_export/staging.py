"""Folders that appear only when complete: an interrupted write (a full disk, Ctrl+C) never leaves one that
looks valid."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def process_alive(pid: int) -> bool:
    """Whether a process `pid` runs (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it replaces `out`, on any error it is removed. Ones left
    by killed builds of `out` (their process gone) are removed first."""
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    for stale in out.parent.glob(f".{out.name}.partial-*") if out.parent.is_dir() else ():
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
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

"""Folders that appear only when complete: an interrupted write (a full disk, Ctrl+C) never leaves one that
looks valid."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator


def remove_orphans(folders: Iterable[Path]) -> None:
    """Remove the folders named `...-PID` whose process is gone (killed before it could remove them)."""
    for folder in folders:
        pid = folder.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success it replaces `out`, on any error it is removed. Ones left
    by killed builds of `out` (their process gone) are removed first."""
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    remove_orphans(out.parent.glob(f".{out.name}.partial-*") if out.parent.is_dir() else ())
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

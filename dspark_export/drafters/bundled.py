"""Bundled drafters for the demo target, addressable by name wherever a drafter folder is accepted."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from dspark_export.errors import CheckpointError

BUNDLED_PREFIX = "demo-"


def bundled_root() -> Path:
    return Path(str(resources.files("dspark_export") / "assets" / "drafters"))


def bundled_drafters() -> list[str]:
    root = bundled_root()
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []


def resolve_drafter(name_or_path: str) -> Path:
    """A drafter folder from a bundled name (`demo-dspark`) or a path."""
    if name_or_path.startswith(BUNDLED_PREFIX) and not Path(name_or_path).exists():
        folder = bundled_root() / name_or_path
        if not (folder / "config.json").is_file():
            known = ", ".join(bundled_drafters()) or "none are installed"
            raise CheckpointError(f"no bundled drafter {name_or_path!r} (bundled: {known})")
        return folder
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"drafter folder {folder} does not exist")
    return folder

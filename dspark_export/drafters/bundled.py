"""Where a drafter named on the command line lives: a bundled drafter of the demo target (`demo-dspark`), a
folder, or a Hugging Face repo id already in the local cache (`deepseek-ai/dspark_qwen3_8b_block7`)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from dspark_common.errors import CheckpointError, ConfigError
from dspark_export.model_stores import cached_snapshots, hf_cache_roots

if TYPE_CHECKING:
    from dspark_export.presets import TargetSpec

BUNDLED_PREFIX = "demo-"
DEMO_DRAFTER = "demo-dspark"  # the demo's default drafter


def bundled_root() -> Path:
    return Path(str(resources.files("dspark_export") / "assets" / "drafters"))


def bundled_drafters() -> list[str]:
    root = bundled_root()
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []


def default_drafter(target_name: str) -> str | None:
    """The drafter a target gets unless told otherwise: demo-dspark for the demo (when installed), else none."""
    return DEMO_DRAFTER if target_name == "demo" and DEMO_DRAFTER in bundled_drafters() else None


def matching_drafter(spec: TargetSpec) -> str | None:
    """The bundled drafter trained for this target (its shapes and tokenizer), whatever file the target came in:
    the demo's default first; None when none fits."""
    from dspark_common.tokenizer import ChatTokenizer
    from dspark_export.drafters.config import DrafterConfig

    if spec.path is None:
        return None
    vocab_hash = ChatTokenizer.from_dir(spec.path).vocab_hash()
    for name in sorted(bundled_drafters(), key=lambda name: name != DEMO_DRAFTER):
        try:
            DrafterConfig.from_dir(bundled_root() / name).check_target(spec.config, vocab_hash)
        except ConfigError:
            continue
        return name
    return None


def resolve_drafter(name_or_path: str) -> Path:
    """A drafter folder from a bundled name, a path or a cached repo id; nothing is downloaded."""
    if name_or_path.startswith(BUNDLED_PREFIX) and not Path(name_or_path).exists():
        folder = bundled_root() / name_or_path
        if not (folder / "config.json").is_file():
            known = ", ".join(bundled_drafters()) or "none are installed"
            raise CheckpointError(f"no bundled drafter {name_or_path!r} (bundled: {known})")
        return folder
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        return folder
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~")):
        snapshots = cached_snapshots(name_or_path)
        if snapshots:
            return snapshots[0]
        places = ", ".join(str(root / ("models--" + name_or_path.replace("/", "--"))) for root in hf_cache_roots())
        raise CheckpointError(f"no local copy of {name_or_path} (looked in {places}); DSpark never downloads: "
                              "pass the drafter's folder")
    raise CheckpointError(f"drafter folder {folder} does not exist")

"""Models found where the tools that downloaded them keep them; nothing is ever downloaded.

Hugging Face snapshots by repository id (`cached_snapshots`, for `--target NAME` and drafters by repo id), and GGUF
files by a `store:name` reference (`find_gguf`):

    ollama:qwen3:8b                 Ollama's store ($OLLAMA_MODELS, ~/.ollama/models, /usr/share/ollama/.ollama/models):
                                    the manifest of model:tag (tag "latest" when left out) names the weights' blob
    lmstudio:Qwen/Qwen3-8B-GGUF     LM Studio's models folder (~/.lmstudio/models, ~/.cache/lm-studio/models)
    hf:Qwen/Qwen3-8B-GGUF           the Hugging Face hub cache (a snapshot's .gguf files)

A folder holding several GGUF files takes the file name after the repository (`lmstudio:Qwen/Qwen3-8B-GGUF/
Qwen3-8B-Q4_K_M.gguf`); the error lists them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dspark_common.errors import CheckpointError

STORES = ("ollama", "lmstudio", "hf")
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"


def is_store_reference(text: str) -> bool:
    return text.split(":", 1)[0] in STORES and ":" in text


def hf_cache_roots() -> list[Path]:
    """Hugging Face hub caches in the order `huggingface_hub` itself consults them."""
    roots = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        roots.append(Path(os.environ["HF_HOME"]) / "hub")
    roots.append(Path.home() / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(roots))


def cached_snapshots(repo_id: str) -> list[Path]:
    """Snapshot folders of `repo_id` in the local caches, the one `refs/main` names first."""
    found = []
    for root in hf_cache_roots():
        repo = root / ("models--" + repo_id.replace("/", "--"))
        main_ref = repo / "refs" / "main"
        if main_ref.is_file():
            found.append(repo / "snapshots" / main_ref.read_text().strip())
        found.extend(sorted((repo / "snapshots").glob("*")))
    return [path for path in dict.fromkeys(found) if (path / "config.json").is_file()]


def store_label(reference: str) -> str:
    """A file-name-safe label of a reference (its engine folder's name): ollama:qwen3:8b -> qwen3-8b."""
    name = reference.split(":", 1)[1].removesuffix(".gguf")
    return name.replace(":", "-").replace("/", "-")


def find_gguf(reference: str) -> Path:
    """The GGUF file a `store:name` reference names, or an error that says where it looked."""
    store, name = reference.split(":", 1)
    return {"ollama": ollama_blob, "lmstudio": lmstudio_file, "hf": hf_cache_file}[store](name)


def ollama_roots() -> list[Path]:
    roots = [Path(os.environ["OLLAMA_MODELS"])] if os.environ.get("OLLAMA_MODELS") else []
    return roots + [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def ollama_blob(name: str) -> Path:
    """The weights blob of an Ollama model `name[:tag]` (`library/` for bare names, a host for `hf.co/...`)."""
    model, _, tag = name.partition(":")
    parts = model.split("/")
    path = [OLLAMA_REGISTRY, "library", *parts] if len(parts) == 1 else \
        [OLLAMA_REGISTRY, *parts] if len(parts) == 2 else parts
    manifests = {root: root / "manifests" / Path(*path) / (tag or "latest") for root in ollama_roots()}
    root = next((root for root, manifest in manifests.items() if manifest.is_file()), None)
    if root is None:
        raise CheckpointError(f"Ollama has no model {name} here (looked for {', '.join(map(str, manifests.values()))}); "
                              f"`ollama pull {name}` fetches it")
    manifest = manifests[root]
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (json.JSONDecodeError, KeyError, TypeError, StopIteration):
        raise CheckpointError(f"{manifest} is not an Ollama manifest with a model layer") from None
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise CheckpointError(f"Ollama's manifest {manifest} names the blob {blob}, which is missing")
    return blob


def lmstudio_file(name: str) -> Path:
    roots = [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]
    return _one_gguf(name, [root / name for root in roots], "LM Studio")


def hf_cache_file(name: str) -> Path:
    org, repo, *file = name.split("/", 2)
    repos = [root / f"models--{org}--{repo}" for root in hf_cache_roots()]
    snapshots = [snapshot for folder in repos for snapshot in sorted((folder / "snapshots").glob("*"))]
    return _one_gguf(name, [snapshot.joinpath(*file) for snapshot in snapshots] or repos, "the Hugging Face cache")


def _one_gguf(name: str, places: list[Path], store: str) -> Path:
    """The GGUF file at one of `places` (a file, or a folder with exactly one .gguf)."""
    for place in places:
        if place.is_file() and place.suffix.lower() == ".gguf":
            return place
        if place.is_dir():
            files = sorted(place.glob("*.gguf"))
            if len(files) == 1:
                return files[0]
            if files:
                raise CheckpointError(f"{place} holds several GGUF files; name one: "
                                      + ", ".join(f"{name}/{file.name}" for file in files))
    raise CheckpointError(f"{store} has no GGUF file {name} here (looked in {', '.join(map(str, places))})")

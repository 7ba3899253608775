"""A draft vocabulary for any drafter: its output layer and sequential head score only the N most frequent target
tokens, and `d2t` maps draft id d to target id d + d2t[d] (speculators' convention, which the graph and the runtime
already read). A token outside the set is never drafted, so verification stays lossless by construction; what it
saves is the output layer's and the Markov head's rows (7 rows x 151,936 tokens is most of a Qwen3 draft call).

The frequencies come from a source the user names, recorded in the drafter's config (and so in the manifest):
distillation files (`.npz`, the target's own generations: the tokens the drafter learns to draft) or a counts file
(`.json`: `{"counts": [...]}` or a list, one count per token id of the tokenizer). `train` writes the counts of its
data beside the drafter (`token_counts.json`), and the bundled demo target carries its own; where a drafter or
target folder holds one, ONNX Runtime engines draft over `default_size(V)` tokens unless told otherwise (the output
layer of a CPU drafter is its largest cost at real sizes: 7 rows x 151,936 tokens is two thirds of a Qwen3-0.6B-shaped
draft call). Numpy only: `build` needs no torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_export.checkpoint import Checkpoint
from dspark_export.drafters.data import Sequences
from dspark_common.errors import ConfigError
from dspark_export.interop.source import OUTPUT_TABLES, DrafterSource

SOURCE_KEY = "draft_vocab_source"  # where a draft vocabulary's frequencies came from, in the config's `extra`
COUNTS_FILE = "token_counts.json"  # token frequencies kept beside a drafter or a target


@dataclass(frozen=True)
class DraftVocab:
    """`--draft-vocab N` with its frequency source (without N: `default_size`)."""

    size: int | None
    counts: tuple[Path, ...]  # distillation .npz files, or one .json counts file

    def choose(self, vocab: int, tokens: int | None) -> tuple[np.ndarray, str]:
        """(the chosen target ids, ascending; a description of the source) for a target of `vocab` rows whose
        tokenizer has `tokens` tokens."""
        if self.size is None:
            return DraftVocab(default_size(vocab), self.counts).choose(vocab, tokens)
        if not 1 <= self.size <= vocab:
            raise ConfigError(f"--draft-vocab {self.size} must lie in 1..{vocab} (the target's vocabulary)")
        if self.size == vocab:
            return np.arange(vocab), "the whole vocabulary"
        if not self.counts:
            raise ConfigError("--draft-vocab needs a frequency source: --draft-vocab-counts FILE (distillation .npz "
                              "files or a .json of counts per token id)")
        counts, origin = token_counts(self.counts, vocab, tokens)
        return most_frequent(counts, self.size), origin


def default_size(vocab: int) -> int:
    """CPU engines draft over half the vocabulary, at most 32,768 tokens (EAGLE-3's and speculators' size for
    Qwen3's 151,936): on the demo that costs no τ at T=0 and 3% at T=1 (measured; the note on issue 25)."""
    return min(vocab // 2, 32768)


def default_draft_vocab(vocab: int, folders: tuple[Path | None, ...]) -> DraftVocab | None:
    """The default for a CPU engine: `default_size` tokens by the first `token_counts.json` among `folders`."""
    for folder in folders:
        if folder is not None and (Path(folder) / COUNTS_FILE).is_file():
            return DraftVocab(default_size(vocab), (Path(folder) / COUNTS_FILE,))
    return None


def write_counts(folder: Path, counts: np.ndarray, source: str) -> None:
    """`token_counts.json` in `folder`: one count per token id, and where they came from."""
    (Path(folder) / COUNTS_FILE).write_text(json.dumps({"source": source, "counts": counts.astype(int).tolist()}))


def token_counts(files: tuple[Path, ...], vocab: int, tokens: int | None) -> tuple[np.ndarray, str]:
    """Counts per target id [vocab] from distillation files or one JSON counts file, and their description."""
    names = ", ".join(Path(f).name for f in files)
    if all(Path(f).suffix == ".npz" for f in files):
        generated = Sequences.load(*files).generated()
        if generated.size and int(generated.max()) >= (tokens or vocab):
            raise ConfigError(f"{names} holds token id {int(generated.max())}, beyond the tokenizer's "
                              f"{tokens or vocab} tokens: it was made for another tokenizer")
        return np.bincount(generated, minlength=vocab)[:vocab], f"{names} ({generated.size} generated tokens)"
    if len(files) != 1 or Path(files[0]).suffix != ".json":
        raise ConfigError(f"--draft-vocab-counts takes distillation .npz files or one .json counts file, not {names}")
    try:
        raw = json.loads(Path(files[0]).read_text())
        counts = np.asarray(raw["counts"] if isinstance(raw, dict) else raw, dtype=np.float64)
        source = raw.get("source", "counts") if isinstance(raw, dict) else "counts"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{files[0]} is not a counts file ({{\"counts\": [...]}}): {exc}") from None
    if counts.ndim != 1 or len(counts) not in {vocab, tokens} or not np.all(np.isfinite(counts)) or counts.min() < 0:
        want = " or ".join(str(n) for n in sorted({vocab, tokens or vocab}))
        raise ConfigError(f"{files[0]} has {counts.size} counts; the target's tokenizer needs {want} non-negative "
                          "counts, one per token id")
    return np.pad(counts, (0, vocab - len(counts))), f"{names} ({source})"


def most_frequent(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` ids with the highest counts (ties to the lower id), ascending."""
    order = np.lexsort((np.arange(len(counts)), -counts))
    return np.sort(order[:size]).astype(np.int64)


def with_draft_vocab(source: DrafterSource, target: Checkpoint, ids: np.ndarray, origin: str) -> DrafterSource:
    """`source` drafting over the target ids `ids` only: the output tables keep those rows (the LM head is taken
    from the target when the drafter shares it) and `d2t` maps them. A drafter that already drafts over a subset
    keeps it when the sizes agree and is refused otherwise (its rows for other tokens are gone); every id of the
    vocabulary is the drafter as it is."""
    config = source.config
    if config.draft_vocab_size is None and len(ids) == config.target["vocab_size"]:
        return source
    if config.draft_vocab_size is not None:
        if config.draft_vocab_size == len(ids):
            return source
        raise ConfigError(f"the drafter in {source.folder} already drafts over {config.draft_vocab_size} tokens (its "
                          f"d2t); --draft-vocab can only keep that size, not {len(ids)}")

    def rows(name: str):
        def read() -> tuple[np.ndarray, str]:
            array, dtype = target.raw(target.lm_head_name()) if name not in source.names() else source.read(name)
            return np.ascontiguousarray(array[ids]), dtype
        return read

    derived = {name: rows(name) for name in OUTPUT_TABLES if name == "lm_head.weight" or name in source.names()}
    derived["d2t"] = lambda: (ids - np.arange(len(ids)), "int64")
    pruned = dataclasses.replace(config, draft_vocab_size=len(ids), own_lm_head=True,
                                 extra=config.extra | {SOURCE_KEY: origin})
    return dataclasses.replace(source, config=pruned, derived=source.derived | derived)

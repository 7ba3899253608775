"""A drafter folder in any layout DSpark reads, seen in ours: a `DrafterConfig` and its tensors by our names.

Layouts differ in their config files, not in tensor names: ours, DeepSpec's and speculators' name the backbone,
the sequential head (`markov_head.*`) and the confidence head (`confidence_head.proj.*`) alike. What an import
must still reconcile is the vocabulary: a draft vocabulary subset (`d2t`), or tables padded to another size
than the target's (Qwen pads 151,669 tokens to 151,936 or 152,064 rows: only rows past the tokenizer differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dspark_export.checkpoint import Checkpoint, TensorInfo, tensor_view
from dspark_export.config import DecoderConfig
from dspark_export.drafters.config import DrafterConfig
from dspark_common.errors import CheckpointError, ConfigError

INPUT_TABLES = ("embed_tokens.weight", "markov_head.markov_w1.weight")  # rows indexed by target token ids
OUTPUT_TABLES = ("lm_head.weight", "markov_head.markov_w2.weight")  # rows score the drafted vocabulary


@dataclass(frozen=True)
class Target:
    """What an import checks a drafter against."""

    config: DecoderConfig
    checkpoint: Checkpoint | None = None  # its tensors: an embedding or LM head that copies them is shared
    tokenizer: Any = None  # its ChatTokenizer: tells padding from tokens, checks our drafters' fingerprint

    @property
    def tokens(self) -> int | None:
        return self.tokenizer.vocab_size if self.tokenizer is not None else None


@dataclass(frozen=True)
class DrafterSource:
    folder: Path
    layout: str  # "dspark" (ours), "deepspec", "speculators", "z-lab"
    config: DrafterConfig
    tensors: dict[str, TensorInfo]  # by our names
    rows: dict[str, int] = field(default_factory=dict)  # tensors cut or zero-padded to this many rows
    identity_d2t: bool = False  # a draft vocabulary that is the first rows of the target's (padding differs)
    derived: dict[str, Callable[[], tuple[np.ndarray, str]]] = field(default_factory=dict)  # made, not stored

    def names(self) -> list[str]:
        """Every tensor this view has, stored or derived (a draft vocabulary's pruned tables and `d2t`)."""
        return sorted(set(self.tensors) | set(self.derived))

    def read(self, name: str) -> tuple[np.ndarray, str]:
        """One tensor by our name: a memory map (bfloat16 as uint16 bits), rows fitted to the target."""
        if name in self.derived:
            return self.derived[name]()
        if name == "d2t" and self.identity_d2t:
            return np.zeros(self.config.draft_vocab_size, np.int64), "int64"
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"drafter weights in {self.folder} lack {name}")
        array = tensor_view(info)
        rows = self.rows.get(name)
        if rows is not None and rows != array.shape[0]:
            array = array[:rows] if rows < array.shape[0] else np.concatenate(
                [array, np.zeros((rows - array.shape[0], *array.shape[1:]), array.dtype)])
        return array, info.dtype

    def target_ids(self) -> np.ndarray | None:
        """The target id of each draft-vocabulary id (None: the draft vocabulary is the target's)."""
        if self.config.draft_vocab_size is None:
            return None
        return np.arange(self.config.draft_vocab_size) + np.asarray(self.read("d2t")[0], np.int64)


def check_geometry(drafter: dict[str, Any], target: Target, where: Path) -> int:
    """The drafter's decoder layers must have the target's attention shape (DSpark's drafter layers are the
    target's); returns their MLP width, which may differ."""
    t = target.config
    heads = drafter.get("num_attention_heads")
    want = {"hidden_size": t.hidden_size, "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim}
    have = {"hidden_size": drafter.get("hidden_size"), "num_attention_heads": heads,
            "num_key_value_heads": drafter.get("num_key_value_heads", heads),
            "head_dim": drafter.get("head_dim") or (drafter.get("hidden_size") or 0) // max(heads or 1, 1)}
    differ = [f"{key} {have[key]} (target {want[key]})" for key in want if have[key] != want[key]]
    if differ:
        raise ConfigError(f"the drafter in {where} does not fit this target: {', '.join(differ)}")
    rope = drafter.get("rope_parameters") or drafter.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", drafter.get("rope_theta", t.rope_theta)))
    if theta != t.rope_theta or (rope.get("rope_type") or rope.get("type") or "default") != t.rope_type:
        raise ConfigError(f"the drafter in {where} uses other rotary embeddings (theta {theta}) than the target "
                          f"({t.rope_theta}, {t.rope_type})")
    if any(kind != "full_attention" for kind in drafter.get("layer_types") or ()):
        raise ConfigError(
            f"the drafter in {where} has sliding-window layers; DSpark's drafters attend to the whole context"
        )
    if drafter.get("attention_bias"):
        raise ConfigError(f"the drafter in {where} has attention biases, which DSpark's drafter layers do not")
    return int(drafter.get("intermediate_size") or t.intermediate_size)


def imported(folder: Path, layout: str, fields: dict[str, Any], tensors: dict[str, TensorInfo], target: Target,
             drafter_vocab: int, renamed: dict[str, str] | None = None) -> DrafterSource:
    """Our view of an imported drafter: `fields` are its DrafterConfig fields but the vocabulary ones, which
    this settles from the stored tables; `drafter_vocab` is the vocabulary its config declares; `renamed` maps
    our tensor names to the layout's where they differ. Without the target's tokenizer any difference in
    vocabulary is refused."""
    vocab, tokens = target.config.vocab_size, target.tokens
    renamed = renamed or {}
    tensors = {ours: tensors[theirs] for ours, theirs in renamed.items() if theirs in tensors} | {
        name: info for name, info in tensors.items() if name not in renamed.values()}
    if drafter_vocab != vocab and (tokens is None or min(drafter_vocab, vocab) < tokens):
        beyond = f": the tokenizer has {tokens} tokens, so more than padding differs" if tokens else ""
        raise ConfigError(f"the drafter in {folder} has a vocabulary of {drafter_vocab}, the target {vocab}{beyond}")
    own = {name: name in tensors and not _same_as_target(tensors[name], target, name)
           for name in ("embed_tokens.weight", "lm_head.weight")}
    rows = {name: vocab for name in INPUT_TABLES if name in tensors}
    draft_vocab, identity = None, False
    if "d2t" in tensors:
        draft_vocab = _checked_d2t(tensors, folder, vocab, tokens)
    elif own["lm_head.weight"] and tensors["lm_head.weight"].shape[0] < vocab:
        draft_vocab, identity = tensors["lm_head.weight"].shape[0], True  # only padding rows are missing
    else:
        rows |= {name: vocab for name in OUTPUT_TABLES if name in tensors}
    config = DrafterConfig(**fields, target=target.config.architecture_fields() | {"dtype": target.config.dtype},
                           vocab_hash=None, draft_vocab_size=draft_vocab, own_embedding=own["embed_tokens.weight"],
                           own_lm_head=own["lm_head.weight"], extra={"layout": layout})
    return DrafterSource(folder, layout, config, tensors, rows, identity)


def _same_as_target(info: TensorInfo, target: Target, name: str) -> bool:
    """A stored embedding or LM head that is a copy of the target's is shared, not stored twice."""
    if target.checkpoint is None:
        return False
    checkpoint = target.checkpoint
    theirs = checkpoint.tensors.get(
        "model.embed_tokens.weight" if name == "embed_tokens.weight" else checkpoint.lm_head_name()
    )
    if theirs is None or theirs.shape != info.shape or theirs.dtype != info.dtype:
        return False
    mine, other = tensor_view(info), tensor_view(theirs)
    step = max(1, (1 << 24) // max(1, mine[0].size))  # compare in slices: an 8B table is 1.2 GB
    return all(np.array_equal(mine[i:i + step], other[i:i + step]) for i in range(0, mine.shape[0], step))


def _checked_d2t(tensors: dict[str, TensorInfo], folder: Path, vocab: int, tokens: int | None) -> int:
    """A stored draft vocabulary: its size, after checking that `d2t` maps it onto distinct target tokens."""
    d2t_info, head = tensors["d2t"], tensors.get("lm_head.weight")
    if head is None:
        raise ConfigError(f"the drafter in {folder} drafts over a vocabulary subset (d2t) but stores no lm_head.weight")
    size = head.shape[0]
    if d2t_info.shape != (size,):
        raise ConfigError(f"d2t in {folder} has shape {list(d2t_info.shape)}; its LM head drafts {size} tokens")
    ids = np.arange(size) + np.asarray(tensor_view(d2t_info), np.int64)
    limit = min(vocab, tokens or vocab)
    if ids.min() < 0 or ids.max() >= limit or np.unique(ids).size != size:
        raise ConfigError(f"d2t in {folder} maps onto ids outside 0..{limit - 1} or onto one id twice")
    return size

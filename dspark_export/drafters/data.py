"""Self-distillation sequences (written by `dspark_export.demo.distill`) as padded training batches (torch is
needed for the batches only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_common.errors import CheckpointError


def token_dtype(vocab_size: int) -> type:
    """The narrowest unsigned type that holds every id of a vocabulary (Qwen3's 151,936 ids need 32 bits)."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


@dataclass
class Sequences:
    tokens: np.ndarray  # uint16 (uint32 past 65,536 tokens), back to back
    starts: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray

    @classmethod
    def load(cls, *files: str | Path) -> "Sequences":
        """One or more distillation files, as one set."""
        parts = [cls._load_one(file) for file in files]
        offsets = np.cumsum([0] + [len(part.tokens) for part in parts[:-1]])
        return cls(np.concatenate([part.tokens for part in parts]),
                   np.concatenate([part.starts + offset for part, offset in zip(parts, offsets)]),
                   np.concatenate([part.lengths for part in parts]),
                   np.concatenate([part.prompt_lengths for part in parts]))

    @classmethod
    def _load_one(cls, file: str | Path) -> "Sequences":
        try:
            with np.load(file) as data:
                return cls(data["tokens"], data["starts"].astype(np.int64), data["lengths"], data["prompt_lengths"])
        except (OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{file} is not a distillation file: {exc}") from None

    def __len__(self) -> int:
        return len(self.lengths)

    def generated(self) -> np.ndarray:
        """The tokens the target generated (what a drafter learns to draft), back to back."""
        return np.concatenate([self.tokens[start + prompt : start + length] for start, length, prompt
                               in zip(self.starts, self.lengths, self.prompt_lengths)] or [self.tokens[:0]])

    def usable(self) -> np.ndarray:
        """Indices of sequences with at least one anchor (two generated tokens)."""
        return np.flatnonzero(self.lengths - np.maximum(self.prompt_lengths, 2) >= 1)

    def batch(self, indices: np.ndarray, max_length: int):
        """Padded tokens [B, T] (T <= max_length, pad 0), lengths [B], first supervised position [B] (torch)."""
        import torch

        lengths = np.minimum(self.lengths[indices], max_length)
        tokens = np.zeros((len(indices), int(lengths.max())), dtype=np.int64)
        for row, (index, length) in enumerate(zip(indices, lengths)):
            tokens[row, :length] = self.tokens[self.starts[index] : self.starts[index] + length]
        return torch.from_numpy(tokens), torch.from_numpy(lengths.astype(np.int64)), torch.from_numpy(
            self.prompt_lengths[indices].astype(np.int64))

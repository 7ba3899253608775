"""Speculation modes: `off` (target only), `fixed:K`, `sync` and `async` (confidence-scheduled)."""

from __future__ import annotations

from dataclasses import dataclass

from dspark_common.errors import InvalidRequestError

MODES = ("off", "fixed", "sync", "async")


@dataclass(frozen=True)
class SpecMode:
    kind: str  # "off" | "fixed" | "sync" | "async"
    drafts: int = 0  # K for fixed:K

    @classmethod
    def parse(cls, text: str | None, default_block: int, scheduled: bool = False) -> "SpecMode":
        """`off`, `fixed:K`, `sync`, `async`. None: `async` when the engine can schedule (a drafter and a speed
        curve: it drafts only when that pays), else fixed at the drafter's γ, or off without a drafter. `fixed:K`
        beyond γ (`default_block`) is refused."""
        if text is None:
            if not default_block:
                return cls("off")
            return cls("async") if scheduled else cls("fixed", default_block)
        kind, _, value = text.partition(":")
        if kind not in MODES or (kind == "fixed") != bool(value):
            raise InvalidRequestError(f"unknown speculation mode {text!r}; use off, fixed:K, sync or async")
        if kind == "fixed":
            try:
                drafts = int(value)
            except ValueError:
                raise InvalidRequestError(f"fixed:K needs an integer K, got {value!r}") from None
            if drafts < 0:
                raise InvalidRequestError("fixed:K needs K >= 0")
            if default_block and drafts > default_block:
                raise InvalidRequestError(
                    f"fixed:{drafts} asks for more drafts than this engine's drafter makes a round (γ = "
                    f"{default_block}); use fixed:1 to fixed:{default_block} (`dspark-export build --gamma N` sets how "
                    "many it drafts)"
                )
            return cls("fixed", drafts)
        return cls(kind)

    @property
    def drafting(self) -> bool:
        return self.kind != "off" and not (self.kind == "fixed" and self.drafts == 0)

    def __str__(self) -> str:
        return f"fixed:{self.drafts}" if self.kind == "fixed" else self.kind

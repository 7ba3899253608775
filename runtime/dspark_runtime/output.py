"""From a request's visible tokens to the text a user sees: decoded incrementally (only the newest tokens
are decoded each step), streamed in deltas that never split a UTF-8 character or show the start of a stop
string, and the report of a stop string, which the step loop turns into the request's finish."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dspark_runtime.logprobs import TokenLogprob


@dataclass
class Delta:
    """What a reply adds in one go: its text, the tokens behind it and where they came from."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    drafted: list[bool] = field(default_factory=list)  # one per token id: an accepted draft (else the target's own)
    verifications: list[tuple[int, int, int]] = field(default_factory=list)  # per target step since the last delta:
    # drafts proposed, verified, accepted

    def spans(self, decode: Callable[[list[int]], str]) -> list[tuple[str, bool]]:
        """The text cut into runs of drafted and target tokens, each token's share of it taken from decoding it
        alone (for display: a character whose bytes span tokens goes to the run that completes it)."""
        runs: list[tuple[str, bool]] = []
        at = 0
        for index, (token, drafted) in enumerate(zip(self.token_ids, self.drafted)):
            last = index == len(self.token_ids) - 1
            end = len(self.text) if last else min(len(self.text), at + len(decode([token]).rstrip("\ufffd")))
            if end > at:
                if runs and runs[-1][1] == drafted:
                    runs[-1] = (runs[-1][0] + self.text[at:end], drafted)
                else:
                    runs.append((self.text[at:end], drafted))
            at = end
        if at < len(self.text):  # text without tokens (a final flush)
            runs.append((self.text[at:], False))
        return runs


@dataclass
class OutputState:
    """Per request: the visible tokens, their text (cut before a stop string) and what was already sent.

    Incremental decoding: the text of the tokens after `prefix` minus that of the tokens from `prefix` to
    `read` is what the tokens after `read` add; a byte-level tokenizer needs the few tokens of context for
    characters that span tokens, and text that ends in an incomplete character waits for its other bytes.
    """

    decode: Callable[[list[int]], str]
    stop: tuple[str, ...]
    streamed: bool = True  # False: nothing is read before the end, so without stop strings decoding waits for it
    visible: list[int] = field(default_factory=list)
    text: str = ""
    stopped: bool = False
    sent_text: str = ""
    sent_tokens: int = 0
    prefix: int = 0
    read: int = 0

    def add(self, tokens: list[int]) -> bool:
        """Take a step's visible tokens; True when a stop string appeared (the text ends before it)."""
        if self.stopped or not tokens:
            return self.stopped
        self.visible += tokens
        start = len(self.text)
        if (self.streamed or self.stop) and self._extend(final=False):
            for stop in self.stop:
                at = self.text.find(stop, max(0, start - len(stop) + 1))
                if at >= 0:
                    self.text, self.stopped = self.text[:at], True
        return self.stopped

    def _extend(self, final: bool) -> bool:
        """Append the text the unread tokens add (at the end, also an incomplete character); whether any was."""
        before = self.decode(self.visible[self.prefix : self.read])
        after = self.decode(self.visible[self.prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return False
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.visible)
        return True

    def take(self, finish_reason: str | None) -> Delta | None:
        """What has not been sent yet (None if nothing): all of it once the request finished, else all but a
        tail that may still become a stop string."""
        hold = 0
        if finish_reason is None:
            for stop in self.stop:
                for size in range(min(len(stop) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(stop[:size]):
                        hold = max(hold, size)
                        break
        elif not self.stopped and self.read < len(self.visible):
            self._extend(final=True)
        shown = self.text[: len(self.text) - hold]
        if len(shown) < len(self.sent_text):  # a stop string cut text already sent: keep what was sent
            shown = self.sent_text
        delta = Delta(shown[len(self.sent_text) :], self.visible[self.sent_tokens :], finish_reason)
        self.sent_text, self.sent_tokens = shown, len(self.visible)
        return delta if (delta.text or delta.token_ids or delta.finish_reason) else None

"""From a request's visible tokens to the text a user sees: streamed deltas that never split a UTF-8
character or show the start of a stop string, and the report of a stop string, which the step loop turns
into the request's finish."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class OutputState:
    """Per request: the visible tokens, their text (cut before a stop string) and what was already sent."""

    decode: Callable[[list[int]], str]
    stop: tuple[str, ...]
    visible: list[int] = field(default_factory=list)
    text: str = ""
    stopped: bool = False
    sent_text: str = ""
    sent_tokens: int = 0

    def add(self, tokens: list[int]) -> bool:
        """Take a step's visible tokens; True when a stop string appeared (the text ends before it)."""
        if self.stopped:
            return True
        self.visible += tokens
        text = self.decode(self.visible)
        for stop in self.stop:
            at = text.find(stop, max(0, len(self.sent_text) - len(stop)))
            if at >= 0:
                text, self.stopped = text[:at], True
        self.text = text
        return self.stopped

    def take(self, finish_reason: str | None) -> Delta | None:
        """What has not been sent yet (None if nothing): all of it once the request finished, else all but a
        tail that may still become a stop string or is an incomplete character."""
        text, hold = self.text, 0
        if finish_reason is None:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its remaining bytes
                hold = len(text) - len(text.rstrip("\ufffd"))
            for stop in self.stop:  # the text might be the start of a stop string
                for size in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:size]):
                        hold = max(hold, size)
                        break
        shown = text[: len(text) - hold] if hold else text
        if len(shown) < len(self.sent_text):  # a stop string cut text already sent: keep what was sent
            shown = self.sent_text
        delta = Delta(shown[len(self.sent_text):], self.visible[self.sent_tokens:], finish_reason)
        self.sent_text, self.sent_tokens = shown, len(self.visible)
        return delta if (delta.text or delta.token_ids or delta.finish_reason) else None

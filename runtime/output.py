"""From emitted tokens to what a user sees: finish rules (EOS, stop tokens, stop strings, max_tokens) and
streamed text deltas that never split a UTF-8 character or show the start of a stop string."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dspark_runtime.sequence import Sequence


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class OutputState:
    """Per request: visible tokens, the text already sent, and the decoder."""

    decode: object  # callable(list[int]) -> str
    eos_ids: tuple[int, ...]
    visible: list[int] = field(default_factory=list)
    sent_text: str = ""
    sent_tokens: int = 0
    text: str = ""

    def accept(self, s: Sequence, tokens: list[int]) -> Delta | None:
        """Record tokens emitted for `s` (setting its finish reason when a rule fires); the new delta."""
        params = s.params
        for token in tokens:
            s.generated.append(token)
            if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
                s.finish_reason = "stop"
                break
            self.visible.append(token)
            if len(s.generated) >= params.max_tokens:
                s.finish_reason = "length"
                break
        if tokens and s.stats.first_token is None:
            s.stats.first_token = time.perf_counter()
        text = self.decode(self.visible)
        hold = 0
        for stop in params.stop:
            at = text.find(stop, max(0, len(self.sent_text) - len(stop)))
            if at >= 0:
                text, s.finish_reason = text[:at], "stop"
        if s.finish_reason is None:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its remaining bytes
                hold = len(text) - len(text.rstrip("\ufffd"))
            for stop in params.stop:  # the text might be the start of a stop string
                for size in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:size]):
                        hold = max(hold, size)
                        break
        shown = text[: len(text) - hold] if hold else text
        if len(shown) < len(self.sent_text):  # a stop string cut text already sent: keep what was sent
            shown = self.sent_text
        delta = Delta(shown[len(self.sent_text):], self.visible[self.sent_tokens:], s.finish_reason)
        self.sent_text, self.sent_tokens, self.text = shown, len(self.visible), shown
        return delta if (delta.text or delta.token_ids or delta.finish_reason) else None

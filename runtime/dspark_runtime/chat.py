"""A multi-turn conversation on top of `Engine`: history, system prompt, context window, one turn at a time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from dspark_runtime.engine import Completion, Engine
from dspark_runtime.output import Delta
from dspark_common.sampling import SamplingParams


@dataclass
class ChatSession:
    engine: Engine
    params: SamplingParams
    spec: str | None = None
    system: str | None = None
    context: int | None = None  # tokens of history kept (default: the engine's context less max_tokens)
    completion: bool = False  # plain text continuation instead of the chat template
    history: list[dict] = field(default_factory=list)
    last: Completion | None = None  # the last reply
    dropped_tokens: int = 0  # of the last prompt, left out to fit the context

    def clear(self) -> None:
        self.history.clear()

    def prompt_for(self, user_text: str) -> str | list[int]:
        """The next turn's prompt: the chat template's token ids, oldest turns dropped to fit (each message
        rendered and tokenized once), or plain text."""
        if self.completion:
            return user_text
        context = self.context or self.engine.manifest.max_context
        budget = max(context - self.params.max_tokens - 1, context // 2)  # leave room for the reply
        head = [{"role": "system", "content": self.system}] if self.system else []
        turns = self.history + [{"role": "user", "content": user_text}]
        tokenizer = self.engine.tokenizer
        while True:
            ids = tokenizer.encode(tokenizer.apply_chat_template(head + turns, add_generation_prompt=True))
            if len(turns) <= 1 or len(ids) <= budget:
                return ids
            turns = turns[2:]  # drop the oldest user/assistant pair

    def send(self, user_text: str) -> Iterator[Delta]:
        """Stream the reply; the turn joins the history when the reply completes (an interrupted one leaves no trace
        that the next turn would read as the model's answer)."""
        request = self.engine.submit(self.prompt_for(user_text), self.params, self.spec, truncate=True)
        self.dropped_tokens = request.dropped_tokens
        text, complete = [], False
        try:
            for delta in request:
                text.append(delta.text)
                yield delta
            complete = True
        finally:
            if not request.done:
                request.cancel()
                request.wait(10)  # the step loop ends it within a step: its figures are final then
            if complete and not self.completion:
                self.history += [
                    {"role": "user", "content": user_text},
                    {"role": "assistant", "content": "".join(text)},
                ]
            self.last = request.completion

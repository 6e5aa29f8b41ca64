"""The hybrid proposer: request-local suffix matches, trusted shared contexts, then a small draft model.

Sources in order of trust. A match inside the request's own tokens outranks a match in another
request's context, which is used only when that context's measured agreement (accepted / proposed,
after a warm-up) is at least the trust threshold; the draft model fills in when neither matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cascadia.draft.suffix import SuffixAutomaton

LOCAL, MODEL = "local", "model"


class SharedContexts(Protocol):
    """Other requests' token sequences, searchable by their recent n-grams (Redis in production)."""

    def lookup(self, suffix: Sequence[int], k: int) -> tuple[str, list[int]] | None: ...
    def publish(self, stream: str, tokens: Sequence[int]) -> None: ...
    def record(self, source: str, proposed: int, accepted: int) -> None: ...
    def trusted(self, source: str) -> bool: ...


class ModelDrafter(Protocol):
    def draft(self, context: Sequence[int], k: int, stream: str) -> list[int]: ...
    def forget(self, stream: str) -> None: ...


@dataclass
class _StreamState:
    automaton: SuffixAutomaton = field(default_factory=SuffixAutomaton)


@dataclass
class HybridProposer:
    shared: SharedContexts | None = None
    model: ModelDrafter | None = None
    min_local_match: int = 2  # tokens of suffix that must repeat before a request-local match is proposed
    shared_ngram: int = 4  # suffix length looked up in the shared contexts
    streams: dict[str, _StreamState] = field(default_factory=dict)

    def known(self, stream: str) -> int:
        state = self.streams.get(stream)
        return len(state.automaton.tokens) if state else 0

    def append(self, stream: str, tokens: Sequence[int]) -> int:
        state = self.streams.setdefault(stream, _StreamState())
        state.automaton.extend(tokens)
        return len(state.automaton.tokens)

    def propose(self, stream: str, k: int) -> tuple[list[int], str]:
        state = self.streams.get(stream)
        if state is None or k <= 0:
            return [], ""
        tokens = state.automaton.tokens
        _, local = state.automaton.propose(k, self.min_local_match)
        if local:
            return local, LOCAL
        if self.shared is not None and len(tokens) >= self.shared_ngram:
            found = self.shared.lookup(tokens[-self.shared_ngram :], k)
            if found is not None and self.shared.trusted(found[0]):
                return found[1], found[0]
        if self.model is not None:
            return self.model.draft(tokens, k, stream), MODEL
        return [], ""

    def observe(self, source: str, proposed: int, accepted: int) -> None:
        if self.shared is not None and source.startswith("shared:"):
            self.shared.record(source, proposed, accepted)

    def forget(self, stream: str, share: bool) -> None:
        state = self.streams.pop(stream, None)
        if self.model is not None:
            self.model.forget(stream)
        if state is not None and share and self.shared is not None:
            self.shared.publish(stream, state.automaton.tokens)

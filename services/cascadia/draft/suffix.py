"""Request-local drafting: the longest suffix of a token sequence that occurred before, and what followed it.

A suffix automaton over the sequence, extended one token at a time in amortised O(1). The state of
the whole sequence's longest suffix that also ends somewhere earlier is the suffix link of the last
state; its first end position says where that earlier occurrence is, so a proposal costs O(k).
"""

from __future__ import annotations

from collections.abc import Iterable


class SuffixAutomaton:
    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._next: list[dict[int, int]] = [{}]
        self._link: list[int] = [-1]
        self._length: list[int] = [0]
        self._first_end: list[int] = [-1]
        self._last = 0
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        token = int(token)
        position = len(self.tokens)
        self.tokens.append(token)
        cur = self._new_state(self._length[self._last] + 1, position)
        p = self._last
        while p != -1 and token not in self._next[p]:
            self._next[p][token] = cur
            p = self._link[p]
        if p == -1:
            self._link[cur] = 0
        else:
            q = self._next[p][token]
            if self._length[p] + 1 == self._length[q]:
                self._link[cur] = q
            else:
                clone = self._new_state(self._length[p] + 1, self._first_end[q])
                self._next[clone] = dict(self._next[q])
                self._link[clone] = self._link[q]
                while p != -1 and self._next[p].get(token) == q:
                    self._next[p][token] = clone
                    p = self._link[p]
                self._link[q] = self._link[cur] = clone
        self._last = cur

    def _new_state(self, length: int, first_end: int) -> int:
        self._next.append({})
        self._link.append(-1)
        self._length.append(length)
        self._first_end.append(first_end)
        return len(self._length) - 1

    def longest_repeat(self) -> tuple[int, int]:
        """(length, end position of an earlier occurrence) of the longest suffix seen before; (0, -1) if none."""
        state = self._link[self._last]
        if state <= 0:
            return 0, -1
        return self._length[state], self._first_end[state]

    def propose(self, k: int, min_match: int = 1) -> tuple[int, list[int]]:
        """k tokens that followed the longest earlier occurrence of the current suffix, and the match length.

        An occurrence that ends less than k tokens before the end is continued by copying from the
        proposal itself (as LZ77 copies overlap): a sequence repeating with period p is proposed as
        that period repeated, not cut off after p tokens.
        """
        length, end = self.longest_repeat()
        if length < min_match or k <= 0:
            return length, []
        period = len(self.tokens) - 1 - end
        proposal = self.tokens[end + 1 : end + 1 + min(k, period)]
        while len(proposal) < k:
            proposal.append(proposal[len(proposal) - period])
        return length, proposal

"""Offline draft evaluation: how well each proposer would have drafted the sequences a fleet captured.

Every source is asked, after each generated token x_n of a captured stream, for up to D tokens;
its draft is scored against what the fleet actually emitted next. Per depth j the agreement is the
share of drafts whose token j is right (among drafts that reach that far and have a truth to meet);
the accepted length is how many leading tokens a greedy verifier would have kept.

The MTP head is scored under two protocols. Teacher-fed: every depth reads the true tokens and the
previous depth's state on the true sequence (what each depth can do at best). Self-fed: the chain
as it runs live, each depth reading the tokens the depths before it drafted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cascadia.bench.report import pyplot
from cascadia.draft.suffix import SuffixAutomaton
from cascadia.engine.batch import Segment
from cascadia.engine.mtp import MtpDrafter, MtpHead
from cascadia.shard.capture import ConfirmedStream

Proposer = Callable[[str, Sequence[int], int], list[int]]  # (stream, context, k) -> draft


@dataclass
class SourceScore:
    depths: int
    attempts: list[int] = field(default_factory=list)
    agreed: list[int] = field(default_factory=list)
    drafts: int = 0  # positions where the source was asked
    accepted: int = 0  # leading tokens a greedy verifier keeps, summed

    def __post_init__(self) -> None:
        self.attempts = [0] * self.depths
        self.agreed = [0] * self.depths

    def add(self, draft: Sequence[int], truth: Sequence[int]) -> None:
        self.drafts += 1
        leading = True
        for j, token in enumerate(draft[: self.depths]):
            if j >= len(truth):
                break
            self.attempts[j] += 1
            right = int(token) == int(truth[j])
            self.agreed[j] += right
            leading = leading and right
            self.accepted += leading

    def add_depth(self, depth: int, right: np.ndarray) -> None:
        """Teacher-fed scores come per depth, not per draft."""
        self.attempts[depth] += int(right.size)
        self.agreed[depth] += int(right.sum())

    def as_dict(self) -> dict:
        return {
            "agreement_per_depth": [a / n if n else None for a, n in zip(self.agreed, self.attempts, strict=True)],
            "attempts_per_depth": self.attempts,
            "drafts": self.drafts,
            "mean_accepted": self.accepted / self.drafts if self.drafts else None,
        }


def score_proposer(streams: dict[str, ConfirmedStream], propose: Proposer, depths: int) -> SourceScore:
    """Ask `propose` after every generated token of every stream."""
    score = SourceScore(depths)
    for name, stream in streams.items():
        tokens = stream.tokens
        for n in range(stream.prompt_length, len(tokens) - 1):
            draft = propose(name, tokens[: n + 1], depths)
            score.add(draft, tokens[n + 1 : n + 1 + depths])
    return score


def suffix_proposer(min_match: int = 2) -> Proposer:
    automata: dict[str, SuffixAutomaton] = {}

    def propose(stream: str, context: Sequence[int], k: int) -> list[int]:
        automaton = automata.setdefault(stream, SuffixAutomaton())
        automaton.extend(context[len(automaton.tokens) :])
        return automaton.propose(k, min_match)[1]

    return propose


def mtp_teacher_fed(head: MtpHead, streams: dict[str, ConfirmedStream]) -> SourceScore:
    """Each depth over each whole stream on the true tokens; depth k at row t predicts x_{t+k+2}."""
    score = SourceScore(head.depths)
    for name, stream in streams.items():
        tokens, n = np.asarray(stream.tokens), len(stream.final_states)
        head.open(name)
        prev = stream.final_states
        try:
            for k in range(head.depths):
                rows = n - k
                if rows <= 0:
                    break
                raw = head.run_depth(k, [Segment(name, 0, rows)], prev[:rows], tokens[k + 1 : k + 1 + rows])
                targets = np.arange(rows) + k + 2
                scored = (targets <= n) & (targets > stream.prompt_length)  # generated tokens only
                if scored.any():
                    predicted = head.logits(raw[scored]).argmax(-1)
                    score.add_depth(k, predicted == tokens[targets[scored]])
                prev = raw
        finally:
            head.close(name)
    return score


def mtp_self_fed(head: MtpHead, streams: dict[str, ConfirmedStream]) -> SourceScore:
    """The live chain: after each generated token, D drafted tokens, each depth reading the ones before."""
    score = SourceScore(head.depths)
    drafter = MtpDrafter(head)
    for name, stream in streams.items():
        tokens, p = stream.tokens, stream.prompt_length
        drafter.open(name)
        try:
            drafter.confirm(name, 0, stream.final_states[:p], tokens[:p])
            drafter.sampled(name, tokens[p])
            for n in range(p, len(tokens) - 1):
                draft = drafter.propose({name: head.depths})[name]
                score.add(draft, tokens[n + 1 : n + 1 + head.depths])
                drafter.confirm(name, n, stream.final_states[n : n + 1], tokens[n : n + 1])
                drafter.sampled(name, tokens[n + 1])
        finally:
            drafter.close(name)
    return score


def shared_proposer(url: str, streams: dict[str, ConfirmedStream], ngram: int = 4) -> Proposer:
    """Other requests' finished sequences in Redis: each stream sees the streams captured before it."""
    import uuid

    from cascadia.draft.shared import RedisContexts

    contexts = RedisContexts(url, ngram=ngram, prefix=f"cascadia-eval-{uuid.uuid4().hex[:8]}:")
    order = list(streams)
    published: set[str] = set()

    def propose(stream: str, context: Sequence[int], k: int) -> list[int]:
        for earlier in order[: order.index(stream)]:
            if earlier not in published:
                contexts.publish(earlier, streams[earlier].tokens)
                published.add(earlier)
        if len(context) < ngram:
            return []
        found = contexts.lookup(list(context[-ngram:]), k)
        return found[1] if found is not None else []

    return propose


def plot(summary: dict, path) -> None:
    plt = pyplot()

    sources = summary["sources"]
    depths = summary["depths"]
    fig, ax = plt.subplots(figsize=(max(6, depths * 1.4), 4))
    width = 0.8 / max(1, len(sources))
    for i, (name, score) in enumerate(sources.items()):
        values = [v if v is not None else 0.0 for v in score["agreement_per_depth"]]
        ax.bar(np.arange(depths) + i * width, values, width, label=name)
    ax.set_xticks(np.arange(depths) + 0.4 - width / 2, [str(d) for d in range(depths)])
    ax.set_xlabel("draft depth")
    ax.set_ylabel("agreement with the emitted token")
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")
    ax.set_title(f"Draft sources on {summary['streams']} captured streams")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

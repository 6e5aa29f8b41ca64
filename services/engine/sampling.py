"""Token choice from one row of logits: greedy, or temperature with top-k / top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # a bias of -100 all but bans a token, +100 all but forces it


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    logprobs: bool = False  # the sampled token's log-prob is wanted (a full softmax per token)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added to its logit before anything else
    grammar: str = ""  # llguidance grammar the generated text must match (`cascadia.engine.grammar`)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.grammar and not self.stop_ids:
            raise ValueError("a grammar needs stop_ids: the tokens that end its text")
        tokens = [token for token, _ in self.logit_bias]
        if len(set(tokens)) != len(tokens) or any(token < 0 for token in tokens):
            raise ValueError(f"logit_bias needs distinct token ids >= 0, got {sorted(tokens)}")
        for token, bias in self.logit_bias:
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


def apply_logit_bias(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """OpenAI's logit_bias on one row of logits or several ([..., V]); a new array when there is any."""
    if not params.logit_bias:
        return logits
    tokens, biases = zip(*params.logit_bias, strict=True)
    biased = logits.astype(np.float32, copy=True)
    biased[..., list(tokens)] += np.asarray(biases, dtype=np.float32)
    return biased


def apply_penalties(logits: np.ndarray, counts: np.ndarray, params: SamplingParams) -> np.ndarray:
    """OpenAI's presence and frequency penalties over the tokens this stream has sampled so far."""
    if not params.penalised:
        return logits
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def scored_tokens(logprobs: np.ndarray, tokens: np.ndarray, top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each row's log-prob of its token, and its `top` best tokens with theirs (best first).

    `logprobs` [N, V] from `log_softmax`, `tokens` [N]: a prompt scored one position ahead.
    """
    out = []
    for row, token in zip(logprobs, tokens, strict=True):
        best = np.argsort(-row, kind="stable")[:top] if top else ()
        # a grammar leaves some rows fewer than `top` possible tokens: the impossible ones are not listed
        out.append((float(row[token]), [(int(t), float(row[t])) for t in best if np.isfinite(row[t])]))
    return out


def filtered_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampled token is drawn from, after temperature, top-k and top-p."""
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = np.exp(log_softmax(scaled))
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = cumulative - probs[order] < params.top_p  # the token that crosses top_p stays
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    probs = filtered_probabilities(logits, params)
    return int(rng.choice(probs.shape[-1], p=probs))


class Constraint(Protocol):
    """A stream's grammar (`cascadia.engine.grammar.TokenConstraint`): mask a row, advance by a token."""

    def mask(self, logits: np.ndarray) -> np.ndarray: ...

    def advance(self, token: int) -> None: ...


@dataclass
class Sampler:
    """One stream's next token as the fleet's last stage picks it, and `generate` alike: the logit bias,
    the penalties over the tokens sampled so far, the grammar's mask, then the choice."""

    params: SamplingParams
    rng: np.random.Generator
    constraint: Constraint | None = None
    counts: np.ndarray | None = None  # how often each token was sampled, kept once a penalty needs it

    @classmethod
    def seeded(cls, params: SamplingParams, constraint: Constraint | None = None) -> Sampler:
        return cls(params, np.random.default_rng(params.seed), constraint)

    def pick(self, logits: np.ndarray) -> tuple[np.ndarray, int]:
        """(the row the token was chosen from, the token) for one row of logits; the stream moves past it."""
        row = apply_logit_bias(logits, self.params)
        if self.params.penalised:
            if self.counts is None:
                self.counts = np.zeros(row.shape[-1], dtype=np.float32)
            row = apply_penalties(row, self.counts, self.params)
        if self.constraint is not None:
            row = self.constraint.mask(row)
        token = choose(row, self.params, self.rng)
        if self.counts is not None:
            self.counts[token] += 1
        if self.constraint is not None:
            self.constraint.advance(token)
        return row, token

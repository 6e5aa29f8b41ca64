"""Token choice from one row of logits: greedy, or temperature with top-k / top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cascadia.sampling_params import SamplingParams


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
    """A stream's grammar (`cascadia.grammar.TokenConstraint`): mask a row, advance by a token."""

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

"""Token choice from one row of logits: greedy, or temperature with top-k / top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_TOP_LOGPROBS = 20


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

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


def apply_penalties(logits: np.ndarray, counts: np.ndarray, params: SamplingParams) -> np.ndarray:
    """OpenAI's presence and frequency penalties over the tokens this stream has sampled so far."""
    if not params.penalised:
        return logits
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


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

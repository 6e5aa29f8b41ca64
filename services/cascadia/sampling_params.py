"""What a request asks of token choice (temperature, top-k/top-p, seed, penalties, bias, grammar, stops),
validated once: shared by the gateway and router that receive it, the wire that carries it and the
engine that applies it (`cascadia.engine.sampling`)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    grammar: str = ""  # llguidance grammar the generated text must match (`cascadia.grammar`)

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

"""Single-process generation over a whole model: prefill in windows, then decode."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.sampling import Sampler, SamplingParams
from cascadia.grammar import GrammarVocabulary


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    ttft_s: float
    decode_tokens_per_s: float


def generate(
    engine: StageEngine,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    prefill_window: int = 64,
    stream: str = "generate",
    vocabulary: GrammarVocabulary | None = None,
) -> Generation:
    """`vocabulary`: the model's tokens, needed when `params` carry a grammar."""
    if not engine.is_first or not engine.is_last:
        raise ValueError("single-process generation needs an engine holding every layer")
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    constraint = None
    if params.grammar:
        if vocabulary is None:
            raise ValueError("a grammar needs the model's vocabulary")
        constraint = vocabulary.constraint(params.grammar, params.stop_ids)
    sampler = Sampler.seeded(params, constraint)

    def pick(logits: np.ndarray) -> int:
        return sampler.pick(logits)[1]

    engine.open(stream)
    try:
        started = time.perf_counter()
        position = 0
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        logits = None
        while position < len(prompt):
            n = min(prefill_window, len(prompt) - position)
            result = engine.step([Segment(stream, position, n)], prompt[position : position + n], np.array([n - 1]))
            logits = result.logits[0]
            position += n
        token = pick(logits)
        ttft = time.perf_counter() - started
        out = [token]
        decode_started = time.perf_counter()
        while len(out) < params.max_tokens and token not in params.stop_ids:
            result = engine.step([Segment(stream, position, 1)], np.array([token]))
            position += 1
            token = pick(result.logits[0])
            out.append(token)
        decode_time = time.perf_counter() - decode_started
        rate = (len(out) - 1) / decode_time if len(out) > 1 and decode_time > 0 else 0.0
        return Generation(out, ttft, rate)
    finally:
        engine.close(stream)

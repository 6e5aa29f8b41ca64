"""What a request must fit before it is admitted: one that a stage would refuse fails its whole frame,
and so every other request sharing it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cascadia.grammar import check_grammar
from cascadia.sampling_params import SamplingParams


@dataclass(frozen=True)
class FleetLimits:
    """As the stages report them; 0 is a limit nobody reported, not checked."""

    vocab: int  # token ids the first stage embeds
    sampled_vocab: int  # tokens the last stage scores
    context: int  # positions of a stream every stage holds
    grammars: bool = True  # the last stage can hold a stream to a grammar
    rewind_slack: int = 0  # positions every stage can step a stream back behind the furthest it was fed


UNREPORTED = FleetLimits(0, 0, 0)  # no stage answered yet: only what needs no stage is checked


def fleet_limits(stage_stats: Sequence) -> FleetLimits:
    """From every stage's `ShardStats`, first stage first."""
    contexts = [s.context for s in stage_stats if s.context]
    return FleetLimits(
        stage_stats[0].vocab_size,
        stage_stats[-1].sampled_vocab,
        min(contexts, default=0),
        stage_stats[-1].grammars,
        min(s.rewind_slack for s in stage_stats),
    )


def check_request(prompt: Sequence[int], params: SamplingParams, limits: FleetLimits) -> None:
    """Raises ValueError naming what does not fit."""
    if limits.vocab:
        outside = [t for t in prompt if not 0 <= t < limits.vocab]
        if outside:
            raise ValueError(f"prompt token id {outside[0]} is outside the vocabulary [0, {limits.vocab})")
    if limits.sampled_vocab:
        beyond = [t for t, _ in params.logit_bias if t >= limits.sampled_vocab]
        if beyond:
            raise ValueError(f"logit_bias names token {beyond[0]}; the model scores [0, {limits.sampled_vocab})")
    if params.grammar:
        if not limits.grammars:
            raise ValueError("the fleet's last stage has no tokenizer to hold the text to a grammar")
        check_grammar(params.grammar)  # what needs no tokenizer; the last stage checks the rest
    if limits.context and len(prompt) + params.max_tokens > limits.context:
        raise ValueError(
            f"{len(prompt)} prompt tokens and max_tokens {params.max_tokens} exceed the fleet's context of "
            f"{limits.context} positions"
        )

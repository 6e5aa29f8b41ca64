"""Checking drafted tokens against the model's own distribution at each drafted position.

A draft of k tokens is verified in one pass over k + 1 positions. Greedy: drafts are accepted while
they equal the argmax, then the argmax at the first mismatch (or after the last draft) is added, so
the output is exactly what greedy decoding without a draft produces. With temperature: every draft
is a point proposal, accepted with probability p(draft); on rejection the token is drawn from p with
the draft's mass removed and renormalised, which leaves the output distributed exactly as plain
sampling from p (speculative sampling with a deterministic proposer).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from cascadia.engine.sampling import SamplingParams, filtered_probabilities
from cascadia.grammar import TokenConstraint


def accept_draft(
    logits: np.ndarray, draft: Sequence[int], params: SamplingParams, rng: np.random.Generator
) -> list[int]:
    """The tokens to emit for a verified block: the accepted drafts, then one token of the model's own.

    `logits` holds len(draft) + 1 rows: row i is the distribution after the block's first i drafts.
    """
    return [token for _, token in verified_tokens(logits, draft, params, rng)]


def verified_tokens(
    logits: np.ndarray,
    draft: Sequence[int],
    params: SamplingParams,
    rng: np.random.Generator,
    constraint: TokenConstraint | None = None,
) -> Iterator[tuple[np.ndarray, int]]:
    """Each emitted token with the row it was chosen from. Under a grammar each row is masked at the
    grammar's place after the tokens before it, so a draft that leaves the grammar has no chance."""
    if logits.shape[0] != len(draft) + 1:
        raise ValueError(f"{len(draft)} drafted tokens need {len(draft) + 1} rows of logits, got {logits.shape[0]}")
    for i, row in enumerate(logits):
        if constraint is not None:
            row = constraint.mask(row)
        token, last = _verify_row(row, draft[i] if i < len(draft) else None, params, rng)
        if constraint is not None:
            constraint.advance(token)
        yield row, token
        if last:
            return


def _verify_row(row: np.ndarray, proposed: int | None, params: SamplingParams, rng: np.random.Generator):
    """The token at one row and whether the block ends with it (no draft left, or the draft was refused)."""
    if params.temperature == 0.0:
        token = int(np.argmax(row))
        return token, proposed is None or token != proposed
    probs = filtered_probabilities(row, params)
    if proposed is None:
        return int(rng.choice(probs.shape[-1], p=probs)), True
    proposed = int(proposed)
    if rng.random() < probs[proposed]:
        return proposed, False
    residual = probs.copy()
    residual[proposed] = 0.0
    total = residual.sum()
    if total <= 0.0:  # p was a point mass on the draft, which rng.random() < 1 always accepts
        return proposed, False
    return int(rng.choice(residual.shape[-1], p=residual / total)), True

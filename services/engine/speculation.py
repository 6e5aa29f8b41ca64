"""Checking drafted tokens against the model's own distribution at each drafted position.

A draft of k tokens is verified in one pass over k + 1 positions. Greedy: drafts are accepted while
they equal the argmax, then the argmax at the first mismatch (or after the last draft) is added, so
the output is exactly what greedy decoding without a draft produces. With temperature: every draft
is a point proposal, accepted with probability p(draft); on rejection the token is drawn from p with
the draft's mass removed and renormalised, which leaves the output distributed exactly as plain
sampling from p (speculative sampling with a deterministic proposer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cascadia.engine.sampling import SamplingParams, filtered_probabilities


def accept_draft(
    logits: np.ndarray, draft: Sequence[int], params: SamplingParams, rng: np.random.Generator
) -> list[int]:
    """The tokens to emit for a verified block: the accepted drafts, then one token of the model's own.

    `logits` holds len(draft) + 1 rows: row i is the distribution after the block's first i drafts.
    """
    if logits.shape[0] != len(draft) + 1:
        raise ValueError(f"{len(draft)} drafted tokens need {len(draft) + 1} rows of logits, got {logits.shape[0]}")
    out: list[int] = []
    for i, row in enumerate(logits):
        if params.temperature == 0.0:
            token = int(np.argmax(row))
            out.append(token)
            if i == len(draft) or token != draft[i]:
                return out
            continue
        probs = filtered_probabilities(row, params)
        if i == len(draft):
            out.append(int(rng.choice(probs.shape[-1], p=probs)))
            return out
        proposed = int(draft[i])
        if rng.random() < probs[proposed]:
            out.append(proposed)
            continue
        residual = probs.copy()
        residual[proposed] = 0.0
        total = residual.sum()
        if total <= 0.0:  # p was a point mass on the draft, which rng.random() < 1 always accepts
            out.append(proposed)
            continue
        out.append(int(rng.choice(residual.shape[-1], p=residual / total)))
        return out
    return out

"""Whether a draft source has earned a place: one rule for the router, which picks among the sources'
drafts, and the draft service, which picks among shared contexts."""

from __future__ import annotations


def earned(proposed: int, accepted: int, threshold: float, warmup: int) -> bool:
    """Trusted during its warm-up (fewer than `warmup` tokens drafted, so it can earn agreement), and after
    it only while at least `threshold` of its drafted tokens were accepted."""
    return proposed < warmup or accepted >= threshold * proposed


def agreement_score(proposed: int, accepted: int) -> float:
    """A source's measured agreement, smoothed so that an unmeasured source starts at one half."""
    return (accepted + 1) / (proposed + 2)

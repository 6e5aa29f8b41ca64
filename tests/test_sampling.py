from __future__ import annotations

import numpy as np
import pytest

from cascadia.engine.sampling import SamplingParams, choose, filtered_probabilities


def test_greedy_takes_the_argmax():
    assert choose(np.array([0.1, 3.0, 2.9]), SamplingParams(), np.random.default_rng(0)) == 1


def test_top_k_and_top_p_cut_the_tail():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert probs[2:].sum() == 0 and probs[:2].sum() == pytest.approx(1)
    probs = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert probs.nonzero()[0].tolist() == [0, 1]


def test_same_seed_same_draws_and_draws_follow_the_distribution():
    logits = np.log(np.array([0.6, 0.4]))
    params = SamplingParams(temperature=1.0, seed=3)
    a = [choose(logits, params, np.random.default_rng(3)) for _ in range(5)]
    b = [choose(logits, params, np.random.default_rng(3)) for _ in range(5)]
    assert a == b
    rng = np.random.default_rng(0)
    draws = [choose(logits, params, rng) for _ in range(4000)]
    assert abs(draws.count(0) / 4000 - 0.6) < 0.03


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_tokens": 0}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)

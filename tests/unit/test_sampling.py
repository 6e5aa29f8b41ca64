from __future__ import annotations

import numpy as np
import pytest

from cascadia.engine.sampling import SamplingParams, apply_logit_bias, choose, filtered_probabilities
from cascadia.wire import sampling_message, sampling_params


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


def test_logit_bias_adds_to_the_named_tokens_of_every_row_and_survives_the_wire():
    params = SamplingParams(logit_bias=((0, 100.0), (2, -100.0)))
    rows = np.array([[0.1, 3.0, 2.9], [5.0, 1.0, 9.0]], dtype=np.float32)
    biased = apply_logit_bias(rows, params)
    np.testing.assert_allclose(biased, [[100.1, 3.0, -97.1], [105.0, 1.0, -91.0]], rtol=1e-6)
    assert rows[0, 0] == pytest.approx(0.1)  # the caller's logits are left alone
    assert choose(biased[0], params, np.random.default_rng(0)) == 0
    assert apply_logit_bias(rows, SamplingParams()) is rows
    assert sampling_params(sampling_message(params)).logit_bias == params.logit_bias


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
        {"max_tokens": 0},
        {"logit_bias": ((3, 101.0),)},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": ((3, 1.0), (3, 2.0))},
    ],
)
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)

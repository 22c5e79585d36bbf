"""learner/value_norm.py against a plain loop: the debiased running mean and std of the targets,
the identity before any update, the variance floor, and a state that survives a checkpoint.
(The learner's use of it, on 2 ZeRO-3 ranks, is in tests/test_update.py.)"""

import math

import numpy as np
import pytest
import torch

from asyncvla.learner.value_norm import MIN_VAR, ValueNorm


def naive_stats(batches, decay):
    """Debiased exponential averages of each batch's mean and mean square, one batch at a time."""
    m = sq = w = 0.0
    for x in batches:
        xs = [float(v) for v in x.flatten()]
        m = decay * m + (1 - decay) * sum(xs) / len(xs)
        sq = decay * sq + (1 - decay) * sum(v * v for v in xs) / len(xs)
        w = decay * w + (1 - decay)
    mean = m / w
    return mean, math.sqrt(max(sq / w - mean * mean, MIN_VAR))


def test_running_statistics_equal_a_plain_loop():
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 4, generator=gen) * (3 + i) + 20 - i for i in range(6)]
    vn = ValueNorm(0.9)
    for b in batches:
        vn.update(b)
    mean, std = naive_stats(batches, 0.9)
    assert vn.mean == pytest.approx(mean, rel=1e-9)
    assert vn.std == pytest.approx(std, rel=1e-9)
    assert vn.mean > 10 and vn.std > 2                   # not the identity


def test_identity_before_any_update_and_a_round_trip_after():
    vn = ValueNorm(0.99)
    x = torch.tensor([[-2.0, 0.5], [3.0, 30.0]])
    assert torch.equal(vn.normalize(x), x) and torch.equal(vn.denormalize(x), x)
    vn.update(torch.tensor([10.0, 30.0]))                # one batch: debiased stats are its own
    assert vn.mean == pytest.approx(20.0) and vn.std == pytest.approx(10.0)
    np.testing.assert_allclose(vn.normalize(torch.tensor([20.0, 30.0])).numpy(), [0.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(vn.denormalize(vn.normalize(x)).numpy(), x.numpy(), rtol=1e-6)


def test_equal_targets_do_not_shrink_the_std_below_the_floor():
    vn = ValueNorm(0.9)
    vn.update(torch.zeros(16))                           # sparse reward, nothing solved yet
    assert vn.std == pytest.approx(math.sqrt(MIN_VAR))
    assert float(vn.normalize(torch.tensor(1.0))) == pytest.approx(10.0)


def test_state_dict_restores_the_statistics():
    a = ValueNorm(0.95)
    for v in (1.0, 4.0, -2.0):
        a.update(torch.tensor([v, 2 * v]))
    b = ValueNorm(0.95)
    b.load_state_dict(a.state_dict())
    assert (b.mean, b.std) == (a.mean, a.std)
    b.update(torch.tensor([7.0]))
    a.update(torch.tensor([7.0]))
    assert (b.mean, b.std) == (a.mean, a.std)


def test_a_decay_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="value_norm_decay=1.0"):
        ValueNorm(1.0)

"""The pure rectified-flow core: t-sampling, ranges, conversions, samplers."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch

from bagel.models import flow


@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (-0.5, 1.5)])
def test_ranges_are_equal_probability_quantiles(count, mean, std):
    ranges = flow.timestep_ranges(count, mean, std)
    assert ranges[0][0] == 0.0 and ranges[-1][1] == 1.0
    for (a, b), (c, _) in pairwise(ranges):
        assert b == c and a < b
    masses = [flow.logit_normal_cdf(hi, mean, std) - flow.logit_normal_cdf(lo, mean, std) for lo, hi in ranges]
    assert masses == pytest.approx([1.0 / count] * count, abs=1e-9)
    # empirical check against the untruncated density
    t = flow.sample_t(40_000, torch.Generator().manual_seed(0), 0.0, 1.0, mean, std)
    emp = [float(((t >= lo) & (t < hi)).float().mean()) for lo, hi in ranges]
    assert emp == pytest.approx([1.0 / count] * count, abs=0.015)


@pytest.mark.parametrize("count,overlap", [(2, 0.05), (4, 0.1), (3, 0.0)])
def test_sampled_t_stays_inside_each_widened_range(count, overlap):
    gen = torch.Generator().manual_seed(1)
    for r in flow.timestep_ranges(count):
        lo, hi = flow.widen(r, overlap)
        assert lo == max(0.0, r[0] - overlap) and hi == min(1.0, r[1] + overlap)
        t = flow.sample_t(5000, gen, lo, hi)
        assert float(t.min()) >= lo and float(t.max()) <= hi
        # it fills the range rather than sitting in a corner of it
        assert float(t.min()) < lo + 0.1 * (hi - lo) and float(t.max()) > hi - 0.1 * (hi - lo)


def test_sample_t_is_a_function_of_the_generator():
    a = flow.sample_t(100, torch.Generator().manual_seed(3), 0.2, 0.7)
    b = flow.sample_t(100, torch.Generator().manual_seed(3), 0.2, 0.7)
    c = flow.sample_t(100, torch.Generator().manual_seed(4), 0.2, 0.7)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("bad", [(0.5, 0.5), (-0.1, 0.5), (0.2, 1.2), (0.7, 0.3)])
def test_bad_ranges_are_rejected(bad):
    with pytest.raises(ValueError):
        flow.sample_t(4, torch.Generator(), *bad)


def test_eps_to_velocity_is_exact_on_synthetic_data():
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(64, 1, 8, 8, generator=gen, dtype=torch.float64)
    eps = torch.randn(64, 1, 8, 8, generator=gen, dtype=torch.float64)
    t = torch.rand(64, generator=gen, dtype=torch.float64) * 0.98
    xt = flow.interpolate(x0, eps, t)
    v_true = eps - x0
    torch.testing.assert_close(flow.eps_to_velocity(eps, xt, t), v_true, rtol=0, atol=1e-10)
    torch.testing.assert_close(flow.x0_to_velocity(x0, xt, t + 0.01), (xt - x0) / (t + 0.01).view(-1, 1, 1, 1))
    torch.testing.assert_close(flow.velocity_to_eps(v_true, xt, t), eps, rtol=0, atol=1e-10)
    # a perfect velocity field integrates back to x0 exactly (straight paths)
    x1 = flow.interpolate(x0, eps, torch.ones(64, dtype=torch.float64))
    out = flow.euler_sample(lambda x, tt: v_true, x1, steps=3)
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-6)


def test_samplers_integrate_a_known_ode():
    # dx/dt = x  => x(0) = x(1) / e ; Heun is far more accurate than Euler at equal steps.
    x1 = torch.ones(2, 1, 2, 2, dtype=torch.float64)
    exact = math.exp(-1)
    e = flow.euler_sample(lambda x, t: x, x1, steps=20)
    h = flow.heun_sample(lambda x, t: x, x1, steps=20)
    assert abs(float(e[0, 0, 0, 0]) - exact) < 0.02
    assert abs(float(h[0, 0, 0, 0]) - exact) < abs(float(e[0, 0, 0, 0]) - exact) / 10


def test_time_grid_and_guidance():
    g = flow.time_grid(4)
    assert g[0] == 1.0 and g[-1] == 0.0 and torch.all(g[1:] < g[:-1])
    shifted = flow.time_grid(4, shift=3.0)
    assert torch.all(shifted[1:-1] > g[1:-1])
    vc, vu = torch.tensor([2.0]), torch.tensor([1.0])
    assert float(flow.guided(vc, vu, 1.0)) == 2.0 and float(flow.guided(vc, vu, 3.0)) == 4.0


def test_rf_loss_is_zero_for_the_exact_velocity():
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 1, 4, 4)
    # a model that knows x0 returns eps - x0 = (x_t - x0) / t
    model = lambda xt, t, y: (xt - x0) / t.view(-1, 1, 1, 1)  # noqa: E731
    loss = flow.rf_loss(model, x0, None, gen, t_range=(0.3, 0.9))
    assert float(loss) < 1e-10


def test_label_dropout_uses_the_null_label():
    y = torch.arange(1000) % 10
    out = flow.drop_labels(y, 10, 0.25, torch.Generator().manual_seed(0))
    frac = float((out == 10).float().mean())
    assert 0.2 < frac < 0.3
    kept = out != 10
    assert torch.equal(out[kept], y[kept])

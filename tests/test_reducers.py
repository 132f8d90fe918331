"""Reducer plug-ins: validation, and each aggregation rule against an independent numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bagel.robust.aggregation import (
    CenteredClip,
    PartRejected,
    ReducerSpecError,
    TrimmedMean,
    WeightedMean,
    get_reducer,
)

RULES = ["mean", "trimmed_mean:0.2", "centered_clip:rel=1.0,iters=10", "centered_clip:tau=0.5"]


def parts(n: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=g) for _ in range(n)]


@pytest.mark.parametrize("rule", RULES)
def test_validation_rejects_non_finite_wrong_shape_and_dtype(rule: str) -> None:
    r = get_reducer(rule)
    r.validate(torch.zeros(5), 5)
    for bad, why in [
        (torch.tensor([0.0, float("nan"), 0.0, 0.0, 0.0]), "non-finite"),
        (torch.tensor([0.0, float("inf"), -float("inf"), 0.0, 0.0]), "2 non-finite"),
        (torch.zeros(4), "shape"),
        (torch.zeros(5, 1), "shape"),
        (torch.zeros(5, dtype=torch.float64), "dtype"),
    ]:
        with pytest.raises(PartRejected, match=why):
            r.validate(bad, 5)


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_is_deterministic_and_exact_on_identical_inputs(rule: str) -> None:
    r = get_reducer(rule)
    xs, ws = parts(5, 257, seed=1), [1.0, 2.0, 3.0, 4.0, 5.0]
    a, b = r.aggregate(xs, ws), r.aggregate([x.clone() for x in xs], list(ws))
    assert a.dtype == torch.float32 and a.shape == (257,)
    assert torch.equal(a, b)
    same = [xs[0].clone() for _ in range(4)]
    assert torch.equal(r.aggregate(same, [1.0, 2.0, 3.0, 4.0]), xs[0])


@pytest.mark.parametrize("rule", RULES)
def test_bad_weights_are_refused(rule: str) -> None:
    r = get_reducer(rule)
    with pytest.raises(ValueError):
        r.aggregate(parts(2, 3), [1.0, 0.0])
    with pytest.raises(ValueError):
        r.aggregate(parts(2, 3), [1.0, float("nan")])
    with pytest.raises(ValueError):
        r.aggregate(parts(2, 3), [1.0])
    with pytest.raises(ValueError):
        r.aggregate([], [])


def test_weighted_mean_matches_numpy_float64() -> None:
    xs, ws = parts(4, 1001, seed=2), [3.0, 1.0, 7.0, 0.5]
    ref = sum(w * x.numpy().astype(np.float64) for x, w in zip(xs, ws, strict=True)) / sum(ws)
    got = WeightedMean().aggregate(xs, ws)
    np.testing.assert_array_equal(got.numpy(), ref.astype(np.float32))


def _trimmed_ref(xs: list[torch.Tensor], ws: list[float], trim: float) -> np.ndarray:
    x = np.stack([t.numpy().astype(np.float64) for t in xs])
    w = np.asarray(ws, dtype=np.float64)
    n = len(xs)
    b = min(max(1, int(np.floor(trim * n))), (n - 1) // 2)
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        order = np.argsort(x[:, j], kind="stable")[b : n - b]
        out[j] = np.sum(x[order, j] * w[order]) / np.sum(w[order])
    return out


def test_trimmed_mean_matches_reference_and_ignores_outliers() -> None:
    honest = parts(6, 300, seed=3)
    evil = [torch.full((300,), 1e6), torch.full((300,), -1e6)]
    xs, ws = honest + evil, [1.0, 2.0, 1.0, 3.0, 1.0, 2.0, 100.0, 100.0]
    got = TrimmedMean(0.25).aggregate(xs, ws)
    np.testing.assert_allclose(got.numpy(), _trimmed_ref(xs, ws, 0.25), rtol=1e-6, atol=1e-6)
    lo = torch.stack(honest).min(0).values
    hi = torch.stack(honest).max(0).values
    assert bool(((got >= lo) & (got <= hi)).all()), "trimmed mean left the honest range"
    # with few parts one value per side is still trimmed (n = 3: the median), and at least one
    # value per coordinate survives; two parts give their midpoint
    np.testing.assert_allclose(TrimmedMean(0.1).aggregate(xs[:3], ws[:3]).numpy(), _trimmed_ref(xs[:3], ws[:3], 0.1))
    two = TrimmedMean(0.49).aggregate(xs[:2], [1.0, 1.0])
    assert torch.equal(two, WeightedMean().aggregate(xs[:2], [1.0, 1.0]))


def _centered_clip_ref(xs: list[torch.Tensor], ws: list[float], tau: float, iters: int) -> np.ndarray:
    """Karimireddy et al. 2021, eq. (CC): v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||)."""
    x = np.stack([t.numpy().astype(np.float64) for t in xs])
    w = np.asarray(ws, dtype=np.float64) / np.sum(ws)
    v = np.sort(x, axis=0)[(len(xs) - 1) // 2]  # lower coordinate-wise median
    for _ in range(iters):
        diff = x - v
        norms = np.linalg.norm(diff, axis=1)
        scale = np.minimum(1.0, tau / np.maximum(norms, 1e-300))
        v = v + np.sum(w[:, None] * scale[:, None] * diff, axis=0)
    return v


def test_centered_clip_matches_reference_and_bounds_byzantine_influence() -> None:
    g = torch.Generator().manual_seed(4)
    mu = torch.randn(200, generator=g)
    honest = [mu + 0.1 * torch.randn(200, generator=g) for _ in range(7)]
    evil = [-30.0 * mu, 50.0 * torch.ones(200)]
    xs, ws = honest + evil, [1.0] * 9
    got = CenteredClip(tau=1.0, iters=5).aggregate(xs, ws)
    np.testing.assert_allclose(got.numpy(), _centered_clip_ref(xs, ws, 1.0, 5), rtol=1e-5, atol=1e-6)
    honest_mean = torch.stack(honest).mean(0)
    plain = WeightedMean().aggregate(xs, ws)
    assert float((got - honest_mean).norm()) < 0.05 * float((plain - honest_mean).norm())
    # relative tau scales with the data: the same robustness on data 1000x larger
    big = CenteredClip(rel=1.0, iters=10).aggregate([x * 1000 for x in xs], ws)
    assert float((big / 1000 - honest_mean).norm()) < 0.05 * float((plain - honest_mean).norm())


def test_centered_clip_without_clipping_is_the_weighted_mean() -> None:
    xs, ws = parts(4, 50, seed=5), [1.0, 2.0, 3.0, 4.0]
    got = CenteredClip(tau=1e9, iters=3).aggregate(xs, ws)
    np.testing.assert_allclose(got.numpy(), WeightedMean().aggregate(xs, ws).numpy(), atol=1e-6)


def test_get_reducer_names_and_errors() -> None:
    assert isinstance(get_reducer(), CenteredClip)
    assert isinstance(get_reducer("mean"), WeightedMean)
    assert get_reducer("trimmed_mean").trim == 0.2
    assert get_reducer("trimmed_mean:0.1").trim == 0.1
    assert get_reducer("trimmed_mean:trim=0.3").trim == 0.3
    cc = get_reducer("centered_clip:tau=2,iters=3")
    assert (cc.tau, cc.iters) == (2.0, 3)
    for r in (
        "mean",
        "trimmed_mean:0.1",
        "centered_clip:rel=0.5,iters=4",
        "centered_clip:tau=2.0,iters=3",
        "mean:max_norm=inf,min_norm=0",
        "mean:min_cosine=-1",
        "trimmed_mean:0.2,min_cosine=0.1",
    ):
        assert get_reducer(get_reducer(r).spec()).spec() == get_reducer(r).spec()
    # the canonical string names every parameter, the screen's included
    assert get_reducer().spec() == "centered_clip:rel=1.0,iters=10,max_norm=10.0,min_norm=0.01,min_cosine=0.0"
    assert get_reducer("mean").spec() == "mean:max_norm=10.0,min_norm=0.01,min_cosine=0.0"
    sc = get_reducer("trimmed_mean:0.3,max_norm=4,min_norm=0.1,min_cosine=-0.5")
    assert (sc.trim, sc.max_norm, sc.min_norm, sc.min_cosine) == (0.3, 4.0, 0.1, -0.5)
    for bad, msg in [
        ("median", "unknown reducer"),
        ("mean:3", "cannot parse parameter"),
        ("trimmed_mean:0.5", r"\(0, 0.5\)"),
        ("trimmed_mean:0", r"\(0, 0.5\)"),
        ("mean:max_norm=1", "above 1"),
        ("centered_clip:min_norm=1", r"\[0, 1\)"),
        ("centered_clip:min_norm=nan", "number"),
        ("centered_clip:min_cosine=1", r"\[-1, 1\)"),
        ("mean:min_cosine=-1.5", r"\[-1, 1\)"),
        ("trimmed_mean:x", "number"),
        ("centered_clip:tau=-1", "positive"),
        ("centered_clip:iters=0", "at least 1"),
        ("centered_clip:foo=1", "unknown parameter"),
    ]:
        with pytest.raises(ReducerSpecError, match=msg):
            get_reducer(bad)

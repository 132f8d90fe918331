"""The rules work through a part a block at a time (to hold no float64 temporary the size of
the part); a result must be the same bits as the whole-vector form, which is written out
here as the reference: primaries, shadows and the coordinator of an older version compare
digests with this one."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

import bagel.robust.aggregation as agg
from bagel.robust.aggregation import CenteredClip, Reducer, TrimmedMean, get_reducer

pytestmark = pytest.mark.timeout(120)


def ref_exact_sum(x: torch.Tensor) -> float:
    x = x.reshape(-1).to(torch.float64)
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, x.new_zeros(1)])
        x = x[0::2] + x[1::2]
    return float(x[0]) if x.numel() else 0.0


def ref_exact_norm(x: torch.Tensor) -> float:
    x = x.to(torch.float64)
    return math.sqrt(ref_exact_sum(x * x))


def ref_centered_clip(r: CenteredClip, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    w = torch.tensor([float(v) for v in weights], dtype=torch.float64)
    w = w / math.fsum(w.tolist())
    x = [p.to(torch.float64) for p in parts]
    v = torch.stack(x).median(dim=0).values
    if r.tau is not None:
        tau = r.tau
    else:
        dists = sorted(ref_exact_norm(xi - v) for xi in x)
        tau = r.rel * dists[(len(dists) - 1) // 2]
        if tau <= 0:
            return v.to(torch.float32)
    for _ in range(r.iters):
        step = torch.zeros_like(v)
        for xi, wi in zip(x, w.tolist(), strict=True):
            diff = xi - v
            norm = ref_exact_norm(diff)
            scale = 1.0 if norm <= tau else tau / norm
            step += diff * (wi * scale)
        v = v + step
        if ref_exact_norm(step) <= r.eps * (1.0 + ref_exact_norm(v)):
            break
    return v.to(torch.float32)


def ref_trimmed_mean(r: TrimmedMean, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    w = torch.tensor([float(v) for v in weights], dtype=torch.float64)
    n = len(parts)
    x = torch.stack([p.to(torch.float64) for p in parts])
    if n <= 2:
        return (x.sum(dim=0) / n).to(torch.float32)
    b = r.trimmed(n)
    vals, idx = torch.sort(x, dim=0, stable=True)
    keep_vals, keep_w = vals[b : n - b], w[idx[b : n - b]]
    num = torch.zeros(x.shape[1], dtype=torch.float64)
    den = torch.zeros(x.shape[1], dtype=torch.float64)
    for k in range(keep_vals.shape[0]):
        num += keep_vals[k] * keep_w[k]
        den += keep_w[k]
    return (num / den).to(torch.float32)


def ref_direction_cosines(parts: Sequence[torch.Tensor]) -> list[float]:
    ref = torch.stack([p.to(torch.float64) for p in parts]).median(dim=0).values
    rn = ref_exact_norm(ref)
    return [ref_exact_sum(p.to(torch.float64) * ref) / (ref_exact_norm(p) * rn) for p in parts]


def _parts(n: int, d: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(d, generator=g) * (1 + i) for i in range(n)]
    if d > 4:  # ties, exact zeros and a negative zero, where a median or a sum could tell blocks apart
        for p in out:
            p[:3] = torch.tensor([0.0, -0.0, 1.5])
        out[0][3] = out[-1][3]
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


SIZES = [0, 1, 2, 7, 8, 9, 16, 17, 63, 64, 65, 1000]  # around blocks of 8 and their powers


@pytest.mark.parametrize("block", [8, 1 << 16])
def test_exact_sums_and_norms_are_the_whole_vector_tree_bit_for_bit(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agg, "_BLOCK", block)
    g = torch.Generator().manual_seed(1)
    for n in [*SIZES, 4097, 70_001]:
        x = torch.randn(n, generator=g, dtype=torch.float64) * 1e3
        if n > 2:
            x[1] = -0.0
        y = torch.randn(n, generator=g, dtype=torch.float64)
        assert agg.exact_sum(x) == ref_exact_sum(x), n
        assert agg.exact_norm(x) == ref_exact_norm(x), n
        assert agg.exact_norm(x.float()) == ref_exact_norm(x.float()), n
        assert agg.exact_distance(x, y) == ref_exact_norm(x - y), n
        assert agg.blockwise_exact_sum(n, lambda a, b, x=x: x[a:b]) == ref_exact_sum(x), n
    # a sum of negative zeros is -0.0 in both (the +0.0 of an odd pass is the same add)
    z = torch.full((block + 3,), -0.0, dtype=torch.float64)
    assert math.copysign(1.0, agg.blockwise_exact_sum(z.numel(), lambda a, b: z[a:b])) == math.copysign(
        1.0, ref_exact_sum(z)
    )


@pytest.mark.parametrize("block", [8, 1 << 16])
@pytest.mark.parametrize(
    "rule", ["centered_clip", "centered_clip:tau=0.5", "centered_clip:rel=0.3,iters=25", "trimmed_mean:0.2"]
)
def test_rules_give_the_whole_vector_forms_bits(block: int, rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agg, "_BLOCK", block)
    r = get_reducer(rule)
    for n in (1, 2, 3, 5, 8):
        for d in SIZES[1:]:
            ps = _parts(n, d, seed=10 * n + d)
            weights = [float(3 + (i * 7) % 5) for i in range(n)]
            got = r.aggregate(ps, weights)
            want = (
                ref_centered_clip(r, ps, weights) if isinstance(r, CenteredClip) else ref_trimmed_mean(r, ps, weights)
            )  # type: ignore[arg-type]
            assert got.dtype == torch.float32 and _bits(got) == _bits(want), (rule, n, d)


@pytest.mark.parametrize("block", [8, 1 << 16])
def test_the_direction_screen_gives_the_whole_vector_forms_cosines(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agg, "_BLOCK", block)
    seen: list[float] = []

    class Recording(Reducer):
        def aggregate(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
            raise NotImplementedError

    r = Recording(min_cosine=2.0)  # every part fails, so every cosine is recorded in its reason
    for d in (9, 65, 1000):
        ps = _parts(4, d, seed=d)
        ps[2] = -ps[2]
        screening = r.screen(ps)
        assert not screening.kept
        seen = [float(reason.split("cosine ")[1].split(" ")[0]) for _, reason in screening.excluded]
        want = [float(f"{c:.3g}") for c in ref_direction_cosines(ps)]
        assert seen == want, d
        norms = [agg.exact_norm(p) for p in ps]
        assert norms == [ref_exact_norm(p) for p in ps]
        # the cosine itself, unrounded
        ref = agg.parts_median(ps)  # a block of the parts in float64 at a time
        assert _bits(ref) == _bits(torch.stack([p.double() for p in ps]).median(dim=0).values)
        cos = [agg._exact_dot(p, ref) / (norms[i] * agg.exact_norm(ref)) for i, p in enumerate(ps)]
        assert cos == ref_direction_cosines(ps)

"""Robust aggregation under known attacks, through the reducer's own path (validate, clamp, screen).

n = 16 honest updates (a common mean plus noise, `bagel.robust.attacks.honest_group`) and f
hostile ones: f = 4 for ALIE (z = 1.5) and IPM (eps = 0.1, 0.5, 1, 3), f = 7 for the crude
attacks (sign flip x1000, random x1000, a finite 1e30 vector, a sign flip claiming 1e9
samples). Each case runs through a real `worker.reducer.Reduction` (fp32 codec, contributors
with a budget of 64 samples each: the clamp the reducer applies), which must agree bit for
bit with `robust.reduction.reduce_one_part` called on the same encoded inputs (the one
reduction of a part that reducers, shadows and the coordinator's check all run).

The bound: a robust rule's relative error ||agg - honest mean|| / ||honest mean|| stays within
ROBUST_BOUND on every attack; the plain mean is shown to exceed it in the same test (with
only the norm screen, ``mean:min_cosine=-1``: IPM with eps = 3 and the 1e9 weight claim;
every crude attack when the rule runs without the screen and the clamp). The screen's
direction check (every rule's default) excludes every IPM part and every sign-flipped one.
bench/aggregation_attacks.py prints the whole table.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from bagel.compression import get_codec
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.reducerspec import DEFAULT_RULE
from bagel.robust.aggregation import DIRECTION_REASON, ZERO_REASON, TrimmedMean, get_reducer
from bagel.robust.attacks import ATTACKS, alie, alie_own, craft, honest_group, ipm_own
from bagel.robust.reduction import PartInput, PartResult, decode_part, reduce_one_part
from bagel.worker.parts import Contributor, Layout
from bagel.worker.reducer import Reduction

N_HONEST = 16
DIM = 2048
BUDGET = 64
NOISE, SPREAD = 0.5, 1.25  # honest noise / signal per coordinate; norms within 1.25x each way
ROBUST_BOUND = 0.6
SEED = 7
PLAIN_MEAN = "mean:min_cosine=-1"  # the weighted mean behind the norm screen only
MEAN_FAILS = {"ipm:3", "weight-1e9"}  # where the plain mean, screened and clamped, still exceeds the bound
CRUDE = {"sign-flip-x1000", "random-x1000", "finite-1e30", "weight-1e9"}
AGAINST = {"ipm:0.1", "ipm:0.5", "ipm:1", "ipm:3", "weight-1e9"}  # honest-sized parts pointing against the group
FP32 = get_codec("fp32")  # lossless for finite float32: the reducer decodes what was sent


def hostile_count(attack: str) -> int:
    return 7 if attack in CRUDE else 4


def case(attack: str) -> tuple[list[torch.Tensor], list[float], torch.Tensor]:
    """(parts, claimed weights, honest weighted mean in float64): honest first, then hostile."""
    g = torch.Generator().manual_seed(SEED)
    honest, claims = honest_group(N_HONEST, DIM, noise=NOISE, spread=SPREAD, generator=g)
    bad = craft(attack, honest, hostile_count(attack), claim=float(BUDGET), generator=g)
    w = torch.tensor(claims, dtype=torch.float64)
    ref = (torch.stack([h.to(torch.float64) for h in honest]) * w[:, None]).sum(0) / w.sum()
    return honest + [p for p, _ in bad], claims + [c for _, c in bad], ref


def rel_err(agg: torch.Tensor, ref: torch.Tensor) -> float:
    return float((agg.to(torch.float64) - ref).norm() / ref.norm())


def names_of(parts: list[torch.Tensor]) -> list[str]:
    return [f"w{i:02d}" for i in range(len(parts))]  # sorted-sender order is the index order


def reduce_encoded(rule: str, parts: list[torch.Tensor], claimed: list[float]) -> tuple[torch.Tensor, PartResult]:
    """`reduce_one_part` over the fp32-encoded parts, each sender's budget BUDGET: (result, PartResult)."""
    inputs = [PartInput(n, w, BUDGET, FP32.encode(p)) for n, p, w in zip(names_of(parts), parts, claimed, strict=True)]
    res = reduce_one_part(FP32, get_reducer(rule), DIM, inputs, None)
    return decode_part(FP32, res.payload, DIM), res


def index(sender: str) -> int:
    return int(sender[1:])


async def through_reduction(rule: str, parts: list[torch.Tensor], claimed: list[float]):
    """The reducer's side of one exchange over a single part: every contribution accepted
    (validate, clamp to the contributor's budget), then reduce_own (screen, aggregate, encode)."""
    names = names_of(parts)
    contributors = tuple(Contributor(n, f"peer-{n}", (), BUDGET) for n in names)
    loop = asyncio.get_running_loop()
    red = Reduction(
        dp.ExchangeTag(run_id="r", cell_id="k0.r0", round=1, reduce_attempt=1, round_attempt=1),
        names[0],
        contributors,
        0,
        [(0, DIM)],
        FP32,
        get_reducer(rule),
        Layout(("x",), ((DIM,),)),
        loop.time() + 30.0,
        loop.time() + 20.0,
    )
    for n, part, w in zip(names, parts, claimed, strict=True):
        red.accept(n, w, FP32.encode(part))
    payload, header = await red.reduce_own()  # the encoded averaged part every member applies
    return decode_part(FP32, payload, DIM), header, names


RULES = [DEFAULT_RULE, "trimmed_mean:0.2", "mean", PLAIN_MEAN, "centered_clip:min_cosine=-1"]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("attack", ATTACKS)
async def test_attack_relative_error_through_the_reducer(rule: str, attack: str) -> None:
    parts, claimed, ref = case(attack)
    result, header, names = await through_reduction(rule, parts, claimed)
    # the one reduction of a part, called directly on the same encoded inputs: same bytes, same exclusions
    pure, res = reduce_encoded(rule, parts, claimed)
    assert torch.equal(result, pure)
    assert list(header.included) == list(res.included)
    assert [(e.sender, e.reason) for e in header.excluded] == list(res.excluded)
    excluded = {index(s): reason for s, reason in res.excluded}
    # no honest part is ever excluded; the crude ones far outside the group's norms all are
    assert all(i >= N_HONEST for i in excluded)
    hostile = set(range(N_HONEST, len(parts)))
    if attack in CRUDE - {"weight-1e9"}:
        assert set(excluded) == hostile
    direction = get_reducer(rule).min_cosine > -1.0
    if attack in AGAINST:  # honest norms: only the direction check sees them
        assert set(excluded) == (hostile if direction else set())
        assert all(r.startswith(DIRECTION_REASON) for r in excluded.values())
    # weight claims count at most the budget
    weights = [min(claimed[index(s)], BUDGET) for s in res.included]
    assert header.total_weight == pytest.approx(sum(weights)) == pytest.approx(res.total_weight)
    err = rel_err(result, ref)
    print(f"\n{attack:<16} {rule:<28} relative error {err:.4g}")
    if get_reducer(rule).params().robust:
        assert err <= ROBUST_BOUND, f"{rule} under {attack}: relative error {err:.4g} > {ROBUST_BOUND}"
    elif rule == PLAIN_MEAN and attack in MEAN_FAILS:
        assert err > ROBUST_BOUND, f"the plain mean under {attack} stayed within {ROBUST_BOUND}: {err:.4g}"
    if attack in CRUDE:  # the rule alone, with the claimed weights and no screen
        bare = rel_err(get_reducer(rule).aggregate(parts, claimed), ref)
        if not get_reducer(rule).params().robust:  # 1e9 claims: the attackers' -x; the rest: x1000 or more
            floor = 1.5 if attack == "weight-1e9" else 100.0
            assert bare > floor, f"the bare mean under {attack}: {bare:.4g}"


def test_the_default_rule_is_robust_and_the_mean_is_not() -> None:
    assert DEFAULT_RULE == "centered_clip"
    assert get_reducer().params().robust and not get_reducer("mean").params().robust


@pytest.mark.parametrize("spread", [1.0, 1.5, 3.0])
@pytest.mark.parametrize("noise", [0.1, 0.5, 1.0, 2.0])
def test_honest_groups_are_never_screened_out(noise: float, spread: float) -> None:
    """Honest norms within a factor 3 each way (9 between extremes), any noise: nothing excluded,
    in groups of 2 to 24 parts."""
    reducer = get_reducer()
    excluded = 0
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        for n in (2, 3, 4, 8, 24):
            parts, _ = honest_group(n, 512, noise=noise, spread=spread, generator=g)
            excluded += len(reducer.screen(parts).excluded)
    assert excluded == 0


def test_zero_and_huge_parts_are_excluded_with_countable_reasons() -> None:
    g = torch.Generator().manual_seed(1)
    honest, _ = honest_group(6, 256, noise=0.5, spread=1.25, generator=g)
    zero, tiny, huge = torch.zeros(256), honest[0] * 1e-4, honest[1] * 50.0
    s = get_reducer().screen([*honest, zero, tiny, huge])
    reasons = dict(s.excluded)
    assert s.kept == tuple(range(6)) and set(reasons) == {6, 7, 8}
    assert reasons[6].startswith(ZERO_REASON) and reasons[7].startswith(ZERO_REASON)
    assert reasons[8].startswith("norm ") and "limit 10x" in reasons[8]
    # a group of two cannot tell who is hostile: the larger of two parts more than 10x apart is
    # out, and both are when more than 100x apart (an exact zero only itself: a zero update
    # whoever else is in the group), so what survives is never 10x above the smaller norm
    assert get_reducer().screen([honest[0], honest[0] * 50.0]).kept == (0,)
    assert get_reducer().screen([honest[0], honest[0] * 0.05]).kept == (1,)
    for bad in (tiny, honest[0] * 1e4):
        assert get_reducer().screen([honest[0], bad]).kept == ()
    assert get_reducer().screen([honest[0], zero]).kept == (0,)
    # parts that are all exactly zero (parameters without gradient) are left alone
    assert get_reducer().screen([torch.zeros(8)] * 3).kept == (0, 1, 2)
    # the screen can be turned off
    assert get_reducer("mean:max_norm=inf,min_norm=0").screen([*honest, zero, huge]).kept == tuple(range(8))


def test_the_direction_check_excludes_updates_against_the_group() -> None:
    """A sign-flipped honest update has an honest norm: only the direction check sees it."""
    g = torch.Generator().manual_seed(3)
    honest, _ = honest_group(6, 512, noise=0.5, spread=1.25, generator=g)
    flipped, sideways = -honest[0], alie_own(honest[1])  # against the group; ALIE's shift keeps a positive cosine
    s = get_reducer().screen([*honest, flipped, sideways])
    reasons = dict(s.excluded)
    assert s.kept == (*range(6), 7) and set(reasons) == {6}
    assert reasons[6].startswith(DIRECTION_REASON) and "limit 0" in reasons[6]
    # the check can be turned off or tightened
    assert get_reducer("centered_clip:min_cosine=-1").screen([*honest, flipped]).kept == tuple(range(7))
    assert get_reducer("mean:min_cosine=0.99").screen([*honest, flipped]).kept == ()
    # in a pair the median is the midpoint, which would keep the larger of two opposed parts: no check
    assert get_reducer().screen([honest[0], flipped * 2.0]).kept == (0, 1)
    # from three on, a hostile third is out, and each sign of the same part counts once
    assert get_reducer().screen([honest[0], honest[1], -honest[2] * 3.0]).kept == (0, 1)
    # parts with no direction (the median is 0) are left alone
    assert get_reducer("mean:min_norm=0").screen([honest[0], -honest[0], torch.zeros(512)]).kept == (0, 1, 2)


def test_trimmed_mean_trims_at_least_one_per_side_from_three_parts() -> None:
    t = TrimmedMean(0.2)
    assert [t.trimmed(n) for n in (1, 2, 3, 4, 5, 9, 10, 20)] == [0, 0, 1, 1, 1, 1, 2, 4]
    honest = [torch.full((4,), v) for v in (1.0, 2.0, 3.0)]
    evil = torch.full((4,), 1e6)
    # n = 4 (floor(0.2 * 4) = 0): the outlier is trimmed anyway
    got = t.aggregate([*honest, evil], [1.0] * 4)
    assert bool((got <= 3.0).all()) and bool((got >= 1.0).all())
    # n = 3: the median
    assert torch.equal(t.aggregate([honest[0], honest[2], evil], [1.0] * 3), honest[2])
    # n = 2: nothing can be trimmed; the midpoint (the coordinate-wise median), weights ignored
    assert torch.equal(t.aggregate(honest[:2], [1.0, 100.0]), torch.full((4,), 1.5))


@pytest.mark.parametrize("attack", ATTACKS)
def test_centered_clip_error_is_bounded_by_its_radius(attack: str) -> None:
    """At hostile weight share delta the fixed point is within about delta / (1 - delta) x tau
    of the honest mean, plus the honest parts' own clipping: checked against tau as the rule
    computes it (median distance of the screened parts to their coordinate-wise median), with
    5% of ||honest mean|| for the clipping term."""
    parts, claimed, ref = case(attack)
    result, res = reduce_encoded(DEFAULT_RULE, parts, claimed)
    included = [index(s) for s in res.included]
    kept = [parts[i].to(torch.float64) for i in included]
    start = torch.stack(kept).median(dim=0).values
    tau = sorted(float((x - start).norm()) for x in kept)[(len(kept) - 1) // 2]
    w = torch.tensor([min(claimed[i], BUDGET) for i in included], dtype=torch.float64)
    delta = float(w[torch.tensor([i >= N_HONEST for i in included])].sum() / w.sum())
    err = float((result.to(torch.float64) - ref).norm())
    assert delta < 0.5
    assert err <= delta / (1 - delta) * tau + 0.05 * float(ref.norm()), (err, delta, tau)


def test_lone_worker_attack_modes() -> None:
    d = torch.tensor([1.0, -2.0, 0.0, 4.0])
    assert torch.equal(ipm_own(d, 0.5), torch.tensor([-0.5, 1.0, -0.0, -2.0]))
    assert torch.equal(alie_own(d, 1.5, 1.0), torch.tensor([-0.5, -5.0, 0.0, -2.0]))
    honest = [torch.tensor([1.0, 3.0]), torch.tensor([3.0, 5.0])]
    assert torch.equal(alie(honest, 1.0), torch.tensor([1.0, 3.0]))

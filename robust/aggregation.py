"""Pluggable reducers for the data plane: validate each received part, screen the group, aggregate.

A reducer owns one part of the flattened pseudo-gradient in a group exchange
(`averaging.py`). It decodes every contribution to that part (its own included), asks
`Reducer.validate` whether to keep it (finite, the right shape), clamps each weight to the
sample budget the coordinator gave its sender (`clamp_weight`), lets `Reducer.screen` drop
parts whose norm is far outside the group's, and `Reducer.aggregate` combines the rest.
Every member applies the bytes of one reducer (the part's primary), so replicas stay
bit-identical whatever the rule; the rules are still written to be
deterministic (fixed summation order, float64 accumulation, stable sorts) so a golden
test and a re-run reproduce the same numbers. Since a part is also reduced by a shadow
and re-checked by the coordinator, on other machines, the rules use no torch reduction
whose summation order depends on the CPU (norms and sums go through `exact_norm` /
`exact_sum` / `math.fsum`; sorts and medians are exact selections).

Rules (select with `get_reducer(name)`; a run picks one with the spec's `diloco.aggregation`,
grammar and defaults in `bagel.protocol.reducerspec`). The breakdown point is the share of
the (clamped) weight hostile parts may hold before they can move the result arbitrarily far:
- ``centered_clip[:tau=T|rel=R,iters=L]`` — the default. CenteredClip (Karimireddy, He &
  Jaggi, "Learning from History for Byzantine Robust Optimization", ICML 2021):
  v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||), from the coordinate-wise median.
  tau is absolute (``tau=``) or ``rel`` x the median distance of the parts to the start,
  since the scale of a pseudo-gradient depends on the model and the learning rate.
  Breakdown point 1/2: with hostile weight share delta < 1/2 the start and tau are set by
  honest parts, and at the fixed point the hostile parts pull with at most delta x tau while
  the honest ones pull back with (1 - delta) x the error, so the error to the honest mean
  is at most about delta / (1 - delta) x tau (plus the honest parts' own clipping).
  Clipping is per part (each reducer sees only its slice), as in hivemind's BTARD.
- ``trimmed_mean[:trim=F]`` — coordinate-wise trimmed mean (Yin et al., "Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates", ICML 2018): per coordinate,
  drop the b smallest and b largest values and take the weighted mean of the rest, with
  b = max(1, floor(F n)) capped at (n - 1) // 2, so from 3 parts on at least one value per
  side is trimmed (floor(0.2 n) is 0 below 5 parts: a trimmed mean that trims nothing is a
  plain mean and is never used). Breakdown point b / n per coordinate. With 1 or 2 parts
  nothing can be trimmed: the result is the coordinate-wise median (the midpoint of two),
  which one of two parts moves at will; no rule is robust there, and the group screen is
  what bounds such a group (it excludes a part far from the other, see `Reducer.screen`).
- ``mean`` — weighted mean, weights = samples clamped by the coordinator's budget.
  Breakdown point 0: one part moves it as far as the screen lets it (max_norm x the median
  part norm, times its weight share). Not robust; kept for comparison and trusted groups.

The group screen (every rule; `Reducer.screen`) runs before the rule: a part whose norm
exceeds ``max_norm`` (default 10) x the group's lower-median part norm is excluded, and one
whose norm is below ``min_norm`` (default 0.01) x the upper-median part norm is excluded as a
zero update (its reason starts with "zero", so an auditor can count them). Then, from 3
parts left on, one whose cosine to the remaining parts' coordinate-wise median is below
``min_cosine`` (default 0) is excluded as pointing against the group ("direction ...": a
sign-flipped update of honest size, which the norm bounds cannot see). The screen needs
the rules' honest majority by count (the medians it compares with), and shares their
breakdown point: the screened mean is still not robust (a hostile part the screen keeps
moves it by up to max_norm x the median norm times its weight share), but nothing it keeps
points against the group.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bagel.protocol.reducerspec import (
    DEFAULT_MAX_NORM,
    DEFAULT_MIN_COSINE,
    DEFAULT_MIN_NORM,
    DEFAULT_RULE,
    ReducerSpec,
    ReducerSpecError,
    parse_reducer_spec,
)

ZERO_REASON = "zero update"  # the prefix of every exclusion for a suspiciously small norm
DIRECTION_REASON = "direction"  # the prefix of every exclusion for an update against the group's


class PartRejected(ValueError):
    """A received part failed validation; `reason` says why. The part is excluded."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def clamp_weight(claimed: float, budget: float) -> float:
    """The weight a part counts with: its sender's claim, at most the sample budget the
    coordinator assigned it (a claim of 1e9 samples counts as the budget)."""
    return min(float(claimed), float(budget))


@dataclass(frozen=True)
class Screening:
    """The group screen's verdict on a list of parts: indices kept, and (index, reason) excluded."""

    kept: tuple[int, ...]
    excluded: tuple[tuple[int, str], ...]
    median_norm: float  # the lower-median part norm the upper bound is relative to


class Reducer(ABC):
    """Validation, the group screen, and an aggregation rule for one part of an exchange."""

    name: str = ""

    def __init__(
        self,
        *,
        max_norm: float = DEFAULT_MAX_NORM,
        min_norm: float = DEFAULT_MIN_NORM,
        min_cosine: float = DEFAULT_MIN_COSINE,
    ):
        self.max_norm, self.min_norm, self.min_cosine = max_norm, min_norm, min_cosine

    def validate(self, part: torch.Tensor, numel: int) -> None:
        """Raise PartRejected unless part is a finite float32 vector of numel elements."""
        if part.dtype != torch.float32:
            raise PartRejected(f"dtype {part.dtype}, expected float32")
        if part.dim() != 1 or part.numel() != numel:
            raise PartRejected(f"shape {tuple(part.shape)}, expected ({numel},)")
        if not bool(torch.isfinite(part).all()):
            bad = int((~torch.isfinite(part)).sum())
            raise PartRejected(f"{bad} non-finite values")

    def screen(self, parts: Sequence[torch.Tensor]) -> Screening:
        """Exclude parts whose norm is far outside the group's (validated parts, any order).

        Upper bound: norm > max_norm x the lower median of the norms. Lower bound: norm <
        min_norm x the upper median ("zero update ..."). With an honest majority (hostile
        parts f < n / 2) both medians lie between two honest norms, so an honest part is
        never excluded while the honest norms stay within a factor min(max_norm,
        1 / min_norm) of each other, and a hostile part kept is within max_norm x an honest
        norm. Taking the lower median for the upper bound and the upper one for the lower
        bound bounds a group of two as well, where nothing tells the hostile part from the
        honest one: of two parts more than max_norm apart the larger is out, and more than
        1 / min_norm apart both are (no valid part: the round fails), so what is averaged is
        never above max_norm x the smaller norm; a hostile partner can stall such a group, not
        blow it up (and an honest part next to a huge one may be labelled a zero update). When
        the lower median is 0 (at least half the parts are exactly zero: parameters without
        gradient, or a zero update in a group of two) there is no scale to compare against
        and the upper bound is not applied (the lower one still flags an exact zero unless
        the upper median is 0 too: then most parts are zero and nothing is excluded).

        Direction (from 3 parts left on; ``min_cosine``, default 0): a part whose cosine to
        the coordinate-wise median of the parts left is below min_cosine is excluded
        ("direction ..."). A sign-flipped honest update has an honest norm, so the norm
        bounds keep it, and the rule then counts it with a full clip radius against the
        group (CenteredClip's fixed point moves by about delta / (1 - delta) x tau, every
        round). The reference is the median, as FLTrust's is a trusted update (Cao, Fang,
        Liu & Gong, "FLTrust: Byzantine-robust Federated Learning via Trust Bootstrapping",
        NDSS 2021, which weights each update by ReLU of its cosine to a server update
        computed on root data): with hostile parts f < n / 2 every coordinate of the
        median lies between two honest values, so it points the honest way, and an update
        against it is refused outright rather than down-weighted (the rule's own weights
        stay the budgets). An honest update points the group's way: in the 8-member cell of
        bench/robust_diloco.py its cosine to the median was 0.48..0.96 over 25 rounds, a
        sign flip's -0.3..-0.9. A hostile part that stays has a non-negative projection on
        the median, so it cannot pull the result against the group, only sideways (ALIE's
        way), where the rule's clipping bounds it. In a group of two the median is the
        midpoint and would keep the larger of two opposed parts, whoever sent it: no check.
        """
        # exact_norm: the same bits on every machine, so a shadow and the coordinator screen alike
        norms = [exact_norm(p) for p in parts]
        if not norms:
            return Screening((), (), 0.0)
        ordered = sorted(norms)
        low, high = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
        kept: list[int] = []
        excluded: list[tuple[int, str]] = []
        for i, norm in enumerate(norms):
            if low > 0 and norm > self.max_norm * low:
                excluded.append(
                    (
                        i,
                        f"norm {norm:.4g} is {norm / low:.4g}x the group's median part norm {low:.4g} "
                        f"(limit {self.max_norm:g}x)",
                    )
                )
            elif norm < self.min_norm * high:
                excluded.append(
                    (
                        i,
                        f"{ZERO_REASON}: norm {norm:.4g} is below {self.min_norm:g}x the group's median "
                        f"part norm {high:.4g}",
                    )
                )
            else:
                kept.append(i)
        if len(kept) >= 3 and self.min_cosine > -1.0:
            kept = self._direction(parts, norms, kept, excluded)
        return Screening(tuple(kept), tuple(sorted(excluded)), low)

    def _direction(
        self, parts: Sequence[torch.Tensor], norms: list[float], kept: list[int], excluded: list[tuple[int, str]]
    ) -> list[int]:
        """The direction check (see `screen`): the parts of `kept` whose cosine to the kept
        parts' coordinate-wise median is at least min_cosine; the others go to `excluded`."""
        ref = parts_median([parts[i].reshape(-1) for i in kept])
        ref_norm = exact_norm(ref)
        if ref_norm == 0.0:  # no direction to compare with (most coordinates' median is 0)
            return kept
        out = []
        for i in kept:
            cos = _exact_dot(parts[i].reshape(-1), ref) / (norms[i] * ref_norm) if norms[i] > 0 else 0.0
            if cos < self.min_cosine:
                excluded.append(
                    (
                        i,
                        f"{DIRECTION_REASON}: cosine {cos:.3g} to the group's coordinate-wise median "
                        f"(limit {self.min_cosine:g})",
                    )
                )
            else:
                out.append(i)
        return out

    @abstractmethod
    def aggregate(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        """Combine validated float32 parts (given in sorted-sender order) into one float32 part."""

    def params(self) -> ReducerSpec:
        """The parsed spec this reducer implements."""
        return ReducerSpec("mean", max_norm=self.max_norm, min_norm=self.min_norm, min_cosine=self.min_cosine)

    def spec(self) -> str:
        """The canonical rule string (every parameter explicit) that `get_reducer` maps back to this reducer."""
        return self.params().text()


_BLOCK = 1 << 16
"""Elements per block where a rule works through a part piece by piece (a power of two, so
`exact_sum`'s tree never pairs elements of two blocks before each block is one node)."""


def exact_sum(x: torch.Tensor) -> float:
    """sum(x) of a float64 vector by a fixed pairwise tree of elementwise adds.

    Two machines must get the same bits (a part's primary and shadow reducers, and the
    coordinator checking them, compare digests): torch's own reductions pick their
    summation order by the vector width the CPU offers at run time, elementwise IEEE adds
    do not depend on it. O(n) work in log2(n) passes. Each pass adds neighbours in pairs;
    a pass over an odd count adds +0.0 to the last one (as if a zero were appended).
    """
    x = x.reshape(-1).to(torch.float64)
    while x.numel() > 1:
        x = _pairs(x)
    return float(x[0]) if x.numel() else 0.0


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """One pass of `exact_sum`'s tree: x[0] + x[1], x[2] + x[3], ... and x[-1] + 0.0 when the
    count is odd (written into one new vector of half the size, not through a padded copy)."""
    m = x.numel()
    half = m // 2
    out = torch.empty((m + 1) // 2, dtype=torch.float64)
    torch.add(x[0 : 2 * half : 2], x[1 : 2 * half : 2], out=out[:half])
    if m % 2:
        out[half:] = x[m - 1 :] + 0.0
    return out


def _tree(x: torch.Tensor, levels: int) -> float:
    """`levels` passes of the tree over a block of at most 2**levels elements: its one node at
    that level of the whole vector's tree (a pass over a lone node adds +0.0 to it, as the
    whole vector's pass does when the block is its odd last node)."""
    for _ in range(levels):
        x = _pairs(x)
    return float(x[0])


def blockwise_exact_sum(numel: int, block: Callable[[int, int], torch.Tensor]) -> float:
    """`exact_sum` of a float64 vector of `numel` elements given block by block: `block(a, b)`
    returns elements [a, b). The same bits as `exact_sum` of the whole vector, holding one
    block at a time: with blocks of 2**k elements aligned at multiples of 2**k, the first k
    passes of the tree over the whole vector only add elements of the same block (and an
    odd count's +0.0 falls on the last block, which then is the odd last node at the same
    passes), so each block's node at pass k is its own `_tree`, and the rest of the tree
    runs over those nodes."""
    if numel <= _BLOCK:
        return exact_sum(block(0, numel)) if numel else 0.0
    levels = _BLOCK.bit_length() - 1
    nodes = [_tree(block(a, min(numel, a + _BLOCK)).reshape(-1), levels) for a in range(0, numel, _BLOCK)]
    return exact_sum(torch.tensor(nodes, dtype=torch.float64))


def exact_norm(x: torch.Tensor) -> float:
    """||x||_2 with `exact_sum`, so it is the same on every machine (block by block: no
    float64 copy of the whole vector)."""
    flat = x.reshape(-1)

    def squares(a: int, b: int) -> torch.Tensor:
        blk = flat[a:b].to(torch.float64)
        return blk * blk

    return math.sqrt(blockwise_exact_sum(flat.numel(), squares))


def exact_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    """||x - y||_2, exactly `exact_norm(x - y)` for float64 vectors, without the difference's copy."""

    def squares(a: int, b: int) -> torch.Tensor:
        d = x[a:b] - y[a:b]
        return d * d

    return math.sqrt(blockwise_exact_sum(x.numel(), squares))


def stacked64(parts: Sequence[torch.Tensor], a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of the parts as the rows of one float64 (n, b - a) matrix. The rules
    take the parts a block of columns at a time, so a reduction holds them once (as given)
    and one block in float64, not a float64 copy of every part: float32 to float64 is
    exact, so a block holds the same values as a whole float64 matrix would."""
    out = torch.empty((len(parts), b - a), dtype=torch.float64)
    for i, p in enumerate(parts):
        out[i] = p.reshape(-1)[a:b]
    return out


def parts_median(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise (lower) median of the parts in float64, one block of columns at a
    time: each column's median is a selection within the column, so the values are those of
    the whole matrix's, without it or the (n, d) index matrix torch also returns."""
    d = parts[0].numel()
    out = torch.empty(d, dtype=torch.float64)
    for a in range(0, d, _BLOCK):
        out[a : a + _BLOCK] = stacked64(parts, a, min(d, a + _BLOCK)).median(dim=0).values
    return out


def _exact_dot(p: torch.Tensor, ref: torch.Tensor) -> float:
    """exact_sum(p.to(float64) * ref) for a vector p and a float64 vector ref, block by block."""
    return blockwise_exact_sum(p.numel(), lambda a, b: p[a:b].to(torch.float64) * ref[a:b])


def _check(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    if not parts:
        raise ValueError("no parts to aggregate")
    if len(parts) != len(weights):
        raise ValueError(f"{len(parts)} parts but {len(weights)} weights")
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"weights must be positive and finite: {list(weights)}")
    return torch.tensor([float(w) for w in weights], dtype=torch.float64)


class WeightedMean(Reducer):
    """sum_i w_i x_i / sum_i w_i, accumulated in float64 in the given order, cast to float32.
    Breakdown point 0 (see the module docstring)."""

    name = "mean"

    def aggregate(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        w = _check(parts, weights)
        acc = torch.zeros(parts[0].numel(), dtype=torch.float64)
        for x, wi in zip(parts, w.tolist(), strict=True):
            acc += x.to(torch.float64) * wi  # one multiply, one add per element: no FMA ambiguity
        return (acc / math.fsum(w.tolist())).to(torch.float32)


class TrimmedMean(Reducer):
    """Coordinate-wise trimmed weighted mean trimming b = max(1, floor(trim n)) <= (n - 1) // 2
    values per side from 3 parts on; the coordinate-wise median below. Breakdown point b / n."""

    name = "trimmed_mean"

    def __init__(self, trim: float = 0.2, **screen: float):
        super().__init__(**screen)
        self.trim = trim
        self.params()  # ReducerSpecError unless trim is in (0, 0.5)

    def params(self) -> ReducerSpec:
        return ReducerSpec(
            "trimmed_mean", trim=self.trim, max_norm=self.max_norm, min_norm=self.min_norm, min_cosine=self.min_cosine
        )

    def trimmed(self, n: int) -> int:
        """How many values per side and coordinate a group of n parts trims (0 only for n <= 2)."""
        return min(max(1, math.floor(self.trim * n)), (n - 1) // 2)

    def aggregate(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        w = _check(parts, weights)
        flat = [p.reshape(-1) for p in parts]
        d = flat[0].numel()
        out = torch.empty(d, dtype=torch.float32)
        # column by column (a block at a time: the parts' block in float64, and the sort's
        # values and indices, for a block only)
        for a in range(0, d, _BLOCK):
            out[a : a + _BLOCK] = self._columns(stacked64(flat, a, min(d, a + _BLOCK)), w)
        return out

    def _columns(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The rule on a block of columns (every column is reduced on its own)."""
        n = x.shape[0]
        if n <= 2:  # nothing to trim: the coordinate-wise median, unweighted (the midpoint of two)
            return (x.sum(dim=0) / n).to(torch.float32)
        b = self.trimmed(n)
        vals, idx = torch.sort(x, dim=0, stable=True)
        keep_vals = vals[b : n - b]
        keep_w = w[idx[b : n - b]]
        num = torch.zeros(x.shape[1], dtype=torch.float64)
        den = torch.zeros(x.shape[1], dtype=torch.float64)
        for r in range(keep_vals.shape[0]):  # fixed order over the kept ranks
            num += keep_vals[r] * keep_w[r]
            den += keep_w[r]
        return (num / den).to(torch.float32)


class CenteredClip(Reducer):
    """Iterative centered clipping around a robust start (see the module docstring).
    Breakdown point 1/2; error about delta / (1 - delta) x tau at hostile weight share delta."""

    name = "centered_clip"

    def __init__(
        self, tau: float | None = None, rel: float = 1.0, iters: int = 10, eps: float = 1e-12, **screen: float
    ):
        super().__init__(**screen)
        self.tau, self.rel, self.iters, self.eps = tau, rel, iters, eps
        self.params()  # ReducerSpecError on a bad parameter

    def params(self) -> ReducerSpec:
        return ReducerSpec(
            "centered_clip",
            tau=self.tau,
            rel=self.rel,
            iters=self.iters,
            max_norm=self.max_norm,
            min_norm=self.min_norm,
            min_cosine=self.min_cosine,
        )

    def aggregate(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        w = _check(parts, weights)
        w = w / math.fsum(w.tolist())
        # The parts stay as given (float32); every operation below takes them to float64 a
        # block at a time (exactly: float32 to float64 loses nothing, and torch promotes a
        # float32 block minus a float64 one to float64 before it subtracts), so a reduction
        # holds one float64 vector (v) and its step, not a float64 copy of every part. Every
        # vector operation is elementwise and every sum is `exact_sum`'s tree: the same bits
        # as the whole-vector form (tests/test_reducers_blockwise.py checks it against that form).
        x = [p.reshape(-1) for p in parts]
        # Robust start: the coordinate-wise (lower) median; a mean would be dragged by outliers.
        v = parts_median(x)
        if self.tau is not None:
            tau = self.tau
        else:
            dists = sorted(exact_distance(xi, v) for xi in x)
            tau = self.rel * dists[(len(dists) - 1) // 2]
            if tau <= 0:  # most parts sit on the median already: it is the answer
                return v.to(torch.float32)
        d = v.numel()
        step = torch.empty_like(v)
        for _ in range(self.iters):
            step.zero_()
            for xi, wi in zip(x, w.tolist(), strict=True):
                norm = exact_distance(xi, v)
                c = wi * (1.0 if norm <= tau else tau / norm)
                for a in range(0, d, _BLOCK):
                    step[a : a + _BLOCK] += (xi[a : a + _BLOCK] - v[a : a + _BLOCK]) * c
            v += step
            if exact_norm(step) <= self.eps * (1.0 + exact_norm(v)):
                break
        return v.to(torch.float32)


def get_reducer(name: str | ReducerSpec = DEFAULT_RULE) -> Reducer:
    """Build a reducer from its spec string ("centered_clip", "trimmed_mean:0.2",
    "mean:max_norm=20"; grammar in `bagel.protocol.reducerspec`) or a parsed one."""
    spec = parse_reducer_spec(name) if isinstance(name, str) else name
    screen = {"max_norm": spec.max_norm, "min_norm": spec.min_norm, "min_cosine": spec.min_cosine}
    if spec.rule == "trimmed_mean":
        return TrimmedMean(spec.trim, **screen)
    if spec.rule == "centered_clip":
        return CenteredClip(tau=spec.tau, rel=spec.rel, iters=spec.iters, **screen)
    return WeightedMean(**screen)


__all__ = [
    "DIRECTION_REASON",
    "ZERO_REASON",
    "CenteredClip",
    "blockwise_exact_sum",
    "exact_distance",
    "exact_norm",
    "exact_sum",
    "parts_median",
    "stacked64",
    "PartRejected",
    "Reducer",
    "ReducerSpecError",
    "Screening",
    "TrimmedMean",
    "WeightedMean",
    "clamp_weight",
    "get_reducer",
]

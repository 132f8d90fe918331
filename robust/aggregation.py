"""Pluggable reducers for the data plane: validate each received part, then aggregate.

A reducer owns one part of the flattened pseudo-gradient in a group exchange
(`averaging.py`). It decodes every contribution to that part (its own included), asks
`Reducer.validate` whether to keep it, and `Reducer.aggregate` combines the kept ones.
Every member applies the bytes of one reducer (the part's primary), so replicas stay
bit-identical whatever the rule; the rules are still written to be
deterministic (fixed summation order, float64 accumulation, stable sorts) so a golden
test and a re-run reproduce the same numbers. Since a part is also reduced by a shadow
and re-checked by the coordinator, on other machines, the rules use no torch reduction
whose summation order depends on the CPU (norms and sums go through `exact_norm` /
`exact_sum` / `math.fsum`; sorts and medians are exact selections).

Rules (select with `get_reducer(name)`; a run picks one with the spec's `diloco.aggregation`):
- ``mean`` — weighted mean, weights = samples clamped by the coordinator's budget. Default.
- ``trimmed_mean[:trim=F]`` — coordinate-wise trimmed mean (Yin et al., "Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates", ICML 2018): per coordinate,
  drop the floor(F*n) smallest and largest values and take the weighted mean of the rest.
- ``centered_clip[:tau=T|rel=R,iters=L]`` — CenteredClip (Karimireddy, He & Jaggi,
  "Learning from History for Byzantine Robust Optimization", ICML 2021):
  v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||), from the coordinate-wise median.
  tau is absolute (``tau=``) or ``rel`` x the median distance of the parts to the start,
  since the scale of a pseudo-gradient depends on the model and the learning rate.
  Clipping is per part (each reducer sees only its slice), as in hivemind's BTARD.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from bagel.protocol.reducerspec import ReducerSpec, ReducerSpecError, parse_reducer_spec


class PartRejected(ValueError):
    """A received part failed validation; `reason` says why. The part is excluded."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Reducer(ABC):
    """Validation plus an aggregation rule for one part of an exchange."""

    name: str = ""

    def validate(self, part: torch.Tensor, numel: int) -> None:
        """Raise PartRejected unless part is a finite float32 vector of numel elements."""
        if part.dtype != torch.float32:
            raise PartRejected(f"dtype {part.dtype}, expected float32")
        if part.dim() != 1 or part.numel() != numel:
            raise PartRejected(f"shape {tuple(part.shape)}, expected ({numel},)")
        if not bool(torch.isfinite(part).all()):
            bad = int((~torch.isfinite(part)).sum())
            raise PartRejected(f"{bad} non-finite values")

    @abstractmethod
    def aggregate(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        """Combine validated float32 parts (given in sorted-sender order) into one float32 part."""

    def spec(self) -> str:
        """The name that `get_reducer` maps back to this reducer."""
        return self.name


def exact_sum(x: torch.Tensor) -> float:
    """sum(x) of a float64 vector by a fixed pairwise tree of elementwise adds.

    Two machines must get the same bits (a part's primary and shadow reducers, and the
    coordinator checking them, compare digests): torch's own reductions pick their
    summation order by the vector width the CPU offers at run time, elementwise IEEE adds
    do not depend on it. O(n) work in log2(n) passes.
    """
    x = x.reshape(-1).to(torch.float64)
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, x.new_zeros(1)])
        x = x[0::2] + x[1::2]
    return float(x[0]) if x.numel() else 0.0


def exact_norm(x: torch.Tensor) -> float:
    """||x||_2 with `exact_sum`, so it is the same on every machine."""
    x = x.to(torch.float64)
    return math.sqrt(exact_sum(x * x))


def _check(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    if not parts:
        raise ValueError("no parts to aggregate")
    if len(parts) != len(weights):
        raise ValueError(f"{len(parts)} parts but {len(weights)} weights")
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"weights must be positive and finite: {list(weights)}")
    return torch.tensor([float(w) for w in weights], dtype=torch.float64)


class WeightedMean(Reducer):
    """sum_i w_i x_i / sum_i w_i, accumulated in float64 in the given order, cast to float32."""

    name = "mean"

    def aggregate(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        w = _check(parts, weights)
        acc = torch.zeros(parts[0].numel(), dtype=torch.float64)
        for x, wi in zip(parts, w.tolist(), strict=True):
            acc += x.to(torch.float64) * wi  # one multiply, one add per element: no FMA ambiguity
        return (acc / math.fsum(w.tolist())).to(torch.float32)


class TrimmedMean(Reducer):
    """Coordinate-wise trimmed weighted mean; at least one value per coordinate survives."""

    name = "trimmed_mean"

    def __init__(self, trim: float = 0.2):
        ReducerSpec("trimmed_mean", trim=trim)  # ReducerSpecError unless trim is in [0, 0.5)
        self.trim = trim

    def spec(self) -> str:
        return ReducerSpec("trimmed_mean", trim=self.trim).text()

    def aggregate(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        w = _check(parts, weights)
        n = len(parts)
        b = min(math.floor(self.trim * n), (n - 1) // 2)
        x = torch.stack([p.to(torch.float64) for p in parts])  # (n, d)
        if b == 0:
            return WeightedMean().aggregate(parts, weights)
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
    """Iterative centered clipping around a robust start (see the module docstring)."""

    name = "centered_clip"

    def __init__(self, tau: float | None = None, rel: float = 1.0, iters: int = 10, eps: float = 1e-12):
        ReducerSpec("centered_clip", tau=tau, rel=rel, iters=iters)  # ReducerSpecError on a bad parameter
        self.tau, self.rel, self.iters, self.eps = tau, rel, iters, eps

    def spec(self) -> str:
        return ReducerSpec("centered_clip", tau=self.tau, rel=self.rel, iters=self.iters).text()

    def aggregate(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        w = _check(parts, weights)
        w = w / math.fsum(w.tolist())
        x = [p.to(torch.float64) for p in parts]
        # Robust start: the coordinate-wise (lower) median; a mean would be dragged by outliers.
        v = torch.stack(x).median(dim=0).values
        if self.tau is not None:
            tau = self.tau
        else:
            dists = sorted(exact_norm(xi - v) for xi in x)
            tau = self.rel * dists[(len(dists) - 1) // 2]
            if tau <= 0:  # most parts sit on the median already: it is the answer
                return v.to(torch.float32)
        for _ in range(self.iters):
            step = torch.zeros_like(v)
            for xi, wi in zip(x, w.tolist(), strict=True):
                diff = xi - v
                norm = exact_norm(diff)
                scale = 1.0 if norm <= tau else tau / norm
                step += diff * (wi * scale)
            v = v + step
            if exact_norm(step) <= self.eps * (1.0 + exact_norm(v)):
                break
        return v.to(torch.float32)


def get_reducer(name: str | ReducerSpec = "mean") -> Reducer:
    """Build a reducer from its spec string ("mean", "trimmed_mean:0.2",
    "centered_clip:rel=1,iters=10"; grammar in `bagel.protocol.reducerspec`) or a parsed one."""
    spec = parse_reducer_spec(name) if isinstance(name, str) else name
    if spec.rule == "trimmed_mean":
        return TrimmedMean(spec.trim)
    if spec.rule == "centered_clip":
        return CenteredClip(tau=spec.tau, rel=spec.rel, iters=spec.iters)
    return WeightedMean()


__all__ = [
    "CenteredClip",
    "exact_norm",
    "exact_sum",
    "PartRejected",
    "Reducer",
    "ReducerSpecError",
    "TrimmedMean",
    "WeightedMean",
    "get_reducer",
]

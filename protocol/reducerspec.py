"""Aggregation rule strings ("centered_clip", "trimmed_mean:0.2", "mean:max_norm=20").

The run spec's `diloco.aggregation` names the rule a group exchange aggregates each part
with; `bagel.robust.aggregation.get_reducer` builds the reducer from the same string, and
the reducer names the canonical string (`ReducerSpec.text`, every parameter explicit) in
each reply, so a re-run of the reduction applies exactly the same rule. The grammar and the
parameter ranges live here, in the bottom layer and without torch, so that the spec parser
refuses a bad rule when the run is defined rather than when its first round reduces.

    rule        = name [":" params]
    name        = "centered_clip" (default) | "trimmed_mean" | "mean"
    params      = param ("," param)*       (the first may omit its name: trim, resp. tau)
    trimmed_mean: trim in (0, 0.5), default 0.2 (at least one value per side is trimmed
                  from 3 parts on; see `bagel.robust.aggregation.TrimmedMean`)
    centered_clip: tau > 0 (absolute radius) or rel > 0 (default 1, times the median
                   distance to the start), iters >= 1 (default 10)
    every rule:   max_norm > 1 (default 10; "inf" turns it off) and min_norm in [0, 1)
                  (default 0.01; 0 turns it off): the group screen, which excludes a part
                  whose norm is above max_norm x the median part norm or below
                  min_norm x the median part norm ("zero ..."), before the rule runs;
                  min_cosine in [-1, 1) (default 0; -1 turns it off): the screen's
                  direction check, which then excludes, from 3 parts on, a part whose
                  cosine to the group's coordinate-wise median is below min_cosine
                  ("direction ...": a sign-flipped update of honest size).

Breakdown points (the fraction of the clamped weight hostile parts may hold before they
can move the result arbitrarily far): mean 0 (bounded only by the screen), trimmed_mean
b/n per coordinate with b = max(1, floor(trim n)) <= (n - 1)/2, centered_clip 1/2. The
direction check needs the same honest majority by count as the median it compares with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

RULES = ("centered_clip", "trimmed_mean", "mean")
DEFAULT_RULE = "centered_clip"
# The screen's defaults: an honest part's norm sits within a small factor of the group's
# median (same model, same cell, same number of inner steps); 10x above or 100x below it is
# an outlier, not noise (tests/test_aggregation_attacks.py draws honest spreads to check).
DEFAULT_MAX_NORM = 10.0
DEFAULT_MIN_NORM = 0.01
# The direction check's default: an honest update points the group's way (cosine to the
# coordinate-wise median 0.48..0.96 in bench/robust_diloco.py's cell), a sign-flipped one
# away from it (-0.3..-0.9); below 0 is against the group, whatever the noise.
DEFAULT_MIN_COSINE = 0.0


class ReducerSpecError(ValueError):
    """An unknown reducer name or a bad parameter in a reducer spec string."""


@dataclass(frozen=True)
class ReducerSpec:
    """A parsed aggregation rule; the parameters a rule does not use keep their defaults."""

    rule: Literal["centered_clip", "trimmed_mean", "mean"] = "centered_clip"
    trim: float = 0.2  # trimmed_mean
    tau: float | None = None  # centered_clip: absolute clipping radius, or None for rel
    rel: float = 1.0  # centered_clip
    iters: int = 10  # centered_clip
    max_norm: float = DEFAULT_MAX_NORM  # screen: reject norm > max_norm x median norm
    min_norm: float = DEFAULT_MIN_NORM  # screen: reject norm < min_norm x median norm
    min_cosine: float = DEFAULT_MIN_COSINE  # screen: reject cosine to the median < min_cosine

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ReducerSpecError(f"unknown reducer {self.rule!r}: use centered_clip, trimmed_mean or mean")
        if self.rule == "trimmed_mean" and not 0.0 < self.trim < 0.5:
            raise ReducerSpecError(f"trimmed_mean: trim must be in (0, 0.5), got {self.trim}")
        if self.rule == "centered_clip":
            if self.tau is not None and not (self.tau > 0 and math.isfinite(self.tau)):
                raise ReducerSpecError(f"centered_clip: tau must be positive, got {self.tau}")
            if not (self.rel > 0 and math.isfinite(self.rel)):
                raise ReducerSpecError(f"centered_clip: rel must be positive, got {self.rel}")
            if self.iters < 1:
                raise ReducerSpecError(f"centered_clip: iters must be at least 1, got {self.iters}")
        if not self.max_norm > 1.0:  # inf allowed: no upper screen
            raise ReducerSpecError(f"{self.rule}: max_norm must be above 1 (or inf), got {self.max_norm}")
        if not 0.0 <= self.min_norm < 1.0:
            raise ReducerSpecError(f"{self.rule}: min_norm must be in [0, 1), got {self.min_norm}")
        if not -1.0 <= self.min_cosine < 1.0:
            raise ReducerSpecError(f"{self.rule}: min_cosine must be in [-1, 1), got {self.min_cosine}")

    @property
    def robust(self) -> bool:
        """Whether the rule itself bounds a hostile minority (the mean does not; the screen helps it)."""
        return self.rule != "mean"

    def text(self) -> str:
        """The canonical string, every parameter explicit; it parses back to an equal ReducerSpec."""
        screen = f"max_norm={self.max_norm},min_norm={self.min_norm},min_cosine={self.min_cosine}"
        if self.rule == "trimmed_mean":
            return f"trimmed_mean:trim={self.trim},{screen}"
        if self.rule == "centered_clip":
            scale = f"tau={self.tau}" if self.tau is not None else f"rel={self.rel}"
            return f"centered_clip:{scale},iters={self.iters},{screen}"
        return f"mean:{screen}"


def _parse_params(rule: str, text: str, positional: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for i, item in enumerate(filter(None, (s.strip() for s in text.split(",")))):
        if "=" in item:
            key, _, value = item.partition("=")
            params[key.strip()] = value.strip()
        elif i == 0 and positional:
            params[positional] = item
        else:
            raise ReducerSpecError(f"{rule}: cannot parse parameter {item!r}")
    return params


def _float(rule: str, params: dict[str, str], key: str, default: float) -> float:
    if key not in params:
        return default
    try:
        value = float(params.pop(key))
    except ValueError as e:
        raise ReducerSpecError(f"{rule}: {key} must be a number") from e
    if math.isnan(value):
        raise ReducerSpecError(f"{rule}: {key} must be a number")
    return value


def parse_reducer_spec(text: str = DEFAULT_RULE) -> ReducerSpec:
    """ "centered_clip", "trimmed_mean:0.2", "mean:max_norm=20" -> ReducerSpec, or ReducerSpecError."""
    rule, _, rest = text.strip().partition(":")
    if rule not in RULES:
        raise ReducerSpecError(f"unknown reducer {rule!r}: use centered_clip, trimmed_mean or mean")
    params = _parse_params(rule, rest, {"trimmed_mean": "trim", "centered_clip": "tau"}.get(rule, ""))
    max_norm = _float(rule, params, "max_norm", DEFAULT_MAX_NORM)
    min_norm = _float(rule, params, "min_norm", DEFAULT_MIN_NORM)
    min_cosine = _float(rule, params, "min_cosine", DEFAULT_MIN_COSINE)
    if rule == "mean":
        spec = ReducerSpec("mean", max_norm=max_norm, min_norm=min_norm, min_cosine=min_cosine)
    elif rule == "trimmed_mean":
        trim = _float(rule, params, "trim", 0.2)
        spec = ReducerSpec("trimmed_mean", trim=trim, max_norm=max_norm, min_norm=min_norm, min_cosine=min_cosine)
    else:
        tau = _float(rule, params, "tau", math.nan) if "tau" in params else None
        rel = _float(rule, params, "rel", 1.0)
        try:
            iters = int(params.pop("iters", "10"))
        except ValueError as e:
            raise ReducerSpecError(f"{rule}: iters must be an integer") from e
        spec = ReducerSpec(
            "centered_clip",
            tau=tau,
            rel=rel,
            iters=iters,
            max_norm=max_norm,
            min_norm=min_norm,
            min_cosine=min_cosine,
        )
    if params:
        raise ReducerSpecError(f"{rule}: unknown parameter(s) {sorted(params)}")
    return spec


__all__ = [
    "DEFAULT_MAX_NORM",
    "DEFAULT_MIN_COSINE",
    "DEFAULT_MIN_NORM",
    "DEFAULT_RULE",
    "RULES",
    "ReducerSpec",
    "ReducerSpecError",
    "parse_reducer_spec",
]

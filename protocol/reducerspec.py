"""Aggregation rule strings ("mean", "trimmed_mean:0.2", "centered_clip:rel=1,iters=10").

The run spec's `diloco.aggregation` names the rule a group exchange aggregates each part
with; the worker's `bagel.robust.aggregation.get_reducer` builds the reducer from the same
string. The grammar and the parameter ranges live here, in the bottom layer and without
torch, so that the spec parser refuses a bad rule when the run is defined rather than when
its first round reduces.

    rule        = "mean" | "trimmed_mean" [":" params] | "centered_clip" [":" params]
    params      = param ("," param)*       (the first may omit its name: trim, resp. tau)
    trimmed_mean: trim in [0, 0.5), default 0.2
    centered_clip: tau > 0 (absolute radius) or rel > 0 (default 1, times the median
                   distance to the start), iters >= 1 (default 10)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RULES = ("mean", "trimmed_mean", "centered_clip")


class ReducerSpecError(ValueError):
    """An unknown reducer name or a bad parameter in a reducer spec string."""


@dataclass(frozen=True)
class ReducerSpec:
    """A parsed aggregation rule; the parameters a rule does not use keep their defaults."""

    rule: Literal["mean", "trimmed_mean", "centered_clip"] = "mean"
    trim: float = 0.2  # trimmed_mean
    tau: float | None = None  # centered_clip: absolute clipping radius, or None for rel
    rel: float = 1.0  # centered_clip
    iters: int = 10  # centered_clip

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ReducerSpecError(f"unknown reducer {self.rule!r}: use mean, trimmed_mean or centered_clip")
        if self.rule == "trimmed_mean" and not 0.0 <= self.trim < 0.5:
            raise ReducerSpecError(f"trimmed_mean: trim must be in [0, 0.5), got {self.trim}")
        if self.rule == "centered_clip":
            if self.tau is not None and not self.tau > 0:
                raise ReducerSpecError(f"centered_clip: tau must be positive, got {self.tau}")
            if not self.rel > 0:
                raise ReducerSpecError(f"centered_clip: rel must be positive, got {self.rel}")
            if self.iters < 1:
                raise ReducerSpecError(f"centered_clip: iters must be at least 1, got {self.iters}")

    def text(self) -> str:
        """The canonical string, which parses back to an equal ReducerSpec."""
        if self.rule == "trimmed_mean":
            return f"trimmed_mean:trim={self.trim}"
        if self.rule == "centered_clip":
            scale = f"tau={self.tau}" if self.tau is not None else f"rel={self.rel}"
            return f"centered_clip:{scale},iters={self.iters}"
        return self.rule


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


def _float(rule: str, params: dict[str, str], key: str) -> float:
    try:
        return float(params.pop(key))
    except ValueError as e:
        raise ReducerSpecError(f"{rule}: {key} must be a number") from e


def parse_reducer_spec(text: str = "mean") -> ReducerSpec:
    """ "mean", "trimmed_mean:0.2", "centered_clip:rel=1,iters=10" -> ReducerSpec, or ReducerSpecError."""
    rule, _, rest = text.strip().partition(":")
    if rule == "mean":
        if rest:
            raise ReducerSpecError(f"mean takes no parameters, got {rest!r}")
        return ReducerSpec()
    if rule == "trimmed_mean":
        params = _parse_params(rule, rest, "trim")
        spec = ReducerSpec("trimmed_mean", trim=_float(rule, params, "trim") if "trim" in params else 0.2)
    elif rule == "centered_clip":
        params = _parse_params(rule, rest, "tau")
        tau = _float(rule, params, "tau") if "tau" in params else None
        rel = _float(rule, params, "rel") if "rel" in params else 1.0
        try:
            iters = int(params.pop("iters", "10"))
        except ValueError as e:
            raise ReducerSpecError(f"{rule}: iters must be an integer") from e
        spec = ReducerSpec("centered_clip", tau=tau, rel=rel, iters=iters)
    else:
        raise ReducerSpecError(f"unknown reducer {rule!r}: use mean, trimmed_mean or centered_clip")
    if params:
        raise ReducerSpecError(f"{rule}: unknown parameter(s) {sorted(params)}")
    return spec


__all__ = ["RULES", "ReducerSpec", "ReducerSpecError", "parse_reducer_spec"]

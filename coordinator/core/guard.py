"""The commit guard: refuse a round whose new state makes the cell's held-out loss jump.

Every member that applied a round's outer step reports, with its state hash, the held-out
loss of the new state and of the round's base state on the cell's fixed guard batch
(`[guard]` in the run spec; the worker measures both on the CPU with fixed noise, so
every honest member reports the same numbers for the same state). When a hash reaches
the commit quorum, `CommitGuard.judge` looks only at the reports that agree on it:

- the new loss is their median, so a hostile minority of the agreeing reports cannot move
  it past the honest values (with f < n/2 of n values hostile, both middle order
  statistics lie between honest values);
- the reference is the cell's last committed held-out loss; when there is none (round 1,
  after a rollback to a checkpoint, a cell whose reports never carried one) it is the
  median of the same reports' base-state losses;
- refused when new > max_loss_ratio x reference + abs_slack. No measurement at all: the
  round is not guarded (an old worker, a simulator), and the next reference is unknown.

What a single-member cell gets: its one report is all there is, so the guard catches an
honest member's own blow-up (a bug, a diverging outer step, a corrupt resume) but not a
hostile member, which can report any number it likes; that needs audits, not a median.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bagel.protocol.runspec import GuardSection


def median(values: Sequence[float]) -> float:
    """The median (the mean of the two middle values for an even count); -1 for none."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return -1.0
    mid = n // 2
    return xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2.0


@dataclass(frozen=True, slots=True)
class GuardVerdict:
    ok: bool
    loss: float  # median held-out loss of the new state (-1 = not measured)
    reference: float  # what it was compared with (-1 = none)
    reason: str = ""


class CommitGuard:
    """The bound of `[guard]`, applied to one round's agreeing reports."""

    def __init__(self, cfg: GuardSection) -> None:
        self.cfg = cfg

    def judge(self, committed_loss: float, losses: Sequence[float], bases: Sequence[float]) -> GuardVerdict:
        """`committed_loss`: the cell's last committed held-out loss (< 0: unknown);
        `losses` / `bases`: the agreeing reports' measurements (unreported ones left out)."""
        new = median([x for x in losses if x >= 0 and math.isfinite(x)])
        if new < 0:
            return GuardVerdict(True, -1.0, -1.0)
        ref = committed_loss if committed_loss >= 0 else median([x for x in bases if x >= 0 and math.isfinite(x)])
        if not self.cfg.enabled or ref < 0:
            return GuardVerdict(True, new, ref)
        bound = self.cfg.max_loss_ratio * ref + self.cfg.abs_slack
        if new > bound:
            why = (
                f"commit guard: held-out loss {new:.4g} > {self.cfg.max_loss_ratio:g} x {ref:.4g}"
                f" + {self.cfg.abs_slack:g} (median of {len(losses)} agreeing reports)"
            )
            return GuardVerdict(False, new, ref, why)
        return GuardVerdict(True, new, ref)


__all__ = ["CommitGuard", "GuardVerdict", "median"]

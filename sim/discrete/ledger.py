"""Accounting of one simulated policy: where every offered FLOP went.

Offered compute is each worker's achieved FLOP/s times the time it was online. The
engine hands every interval of every online worker to exactly one bucket, so the buckets
add up to the offered compute (a test checks the identity):

- `committed`: training in rounds that committed, by contributors whose hash agreed;
- `aborted`: training in rounds that were aborted (no quorum, timeout, orphaned);
- `straggler`: training by members who were not frozen in (cut off at the deadline) or
  who sat a committed round out;
- `preempted`: training by a worker that died or was cut off before its contribution counted;
- `rejected`: training whose reported hash disagreed with the committed one (Byzantine);
- `resync`: state downloads (joins, moves, resyncs after a bad hash);
- `comm`: the pseudo-gradient exchange while the GPU idles (with overlap: what training ahead leaves);
- `barrier`: trained and waiting: for slower members to be ready, for the verdict, at a
  lock-step barrier, or hung in a broken lock-step collective;
- `idle`: no work: standby, waiting for the next round (e.g. holding the committed state
  while a round runs without it), or for an instruction;
- `unresolved`: training in rounds still open when the simulation ended.

Training time is held per (cell, round, attempt) until the round's fate is known. Goodput
is `committed / offered`; utilisation is all training (wasted or not) over offered.

Training ahead (`[diloco] overlap = "delayed"`, see workers.py) is training too: while a
worker exchanges, awaits its verdict or waits for the next round, its GPU trains the next
round's steps, and that time is held on the worker instead of going to comm, barrier or
idle. Steps the next round takes join its pending training here (and settle with it); the
rest is `aborted` (`preempted` if the worker left or was cut off, `unresolved` at the
end). `ahead_*` tally it: FLOPs trained ahead and carried, rounds that trained ahead and
that carried steps, and why the others' steps were thrown away.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

# the buckets are the shared ones (bagel.protocol.goodput: names, definitions, waste and
# training groups), which the real worker's accounting (worker/goodput.py) uses too
from bagel.protocol.goodput import BUCKETS

RoundKey = tuple[str, int, int]  # (cell, round, attempt)


@dataclass
class Ledger:
    buckets: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    offered: float = 0.0
    # pending training: round key -> worker index -> [flops, cause override or ""]
    pending: dict[RoundKey, dict[int, list]] = field(default_factory=lambda: defaultdict(dict))
    committed_rounds: int = 0
    commits: list[tuple[float, str, int]] = field(default_factory=list)  # (t_s, cell, samples)
    aborts: int = 0
    abort_reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    faults: list[tuple[float, str, int]] = field(default_factory=list)  # (t_s, kind, workers hit)
    core_errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ahead_trained: float = 0.0  # FLOPs trained ahead, settled (carried or thrown away)
    ahead_carried: float = 0.0  # of which carried into the next round's training
    ahead_rounds: int = 0  # weighted exchanges a worker trained ahead during
    ahead_kept: int = 0  # of which the next round took some steps
    # why the others' steps were thrown away: reason -> [exchanges, FLOPs]
    ahead_dropped: dict[str, list[float]] = field(default_factory=dict)
    # syncs that tried to catch up by committed updates: "tried", of which "caught up" or
    # "no donor held them" (those downloaded the whole state after), and the "rounds" the
    # successful ones applied
    catch_up: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, bucket: str, flops: float) -> None:
        if flops > 0:
            self.buckets[bucket] += flops

    def train(self, key: RoundKey, widx: int, flops: float) -> None:
        if flops <= 0:
            return
        entry = self.pending[key].get(widx)
        if entry is None:
            self.pending[key][widx] = [flops, ""]
        else:
            entry[0] += flops

    def mark(self, key: RoundKey, widx: int, cause: str) -> None:
        entry = self.pending.get(key, {}).get(widx)
        if entry is not None and not entry[1]:
            entry[1] = cause

    def resolve_commit(self, key: RoundKey, useful: set[int], rejected: set[int]) -> None:
        """`useful`: contributors whose pseudo-gradient is in the committed average (every
        frozen contributor of the committed exchange: the exchange completed, whatever order
        the reports then came in); `rejected`: contributors whose update does not count
        (Byzantine). Everyone else who trained sat the round out (straggler) unless a cause
        was marked (preempted)."""
        for widx, (flops, cause) in self.pending.pop(key, {}).items():
            if widx in useful:
                self.buckets["committed"] += flops
            elif widx in rejected:
                self.buckets["rejected"] += flops
            elif cause:
                self.buckets[cause] += flops
            else:
                self.buckets["straggler"] += flops

    def resolve_abort(self, key: RoundKey) -> None:
        for flops, _cause in self.pending.pop(key, {}).values():
            self.buckets["aborted"] += flops

    def close(self) -> None:
        for key in list(self.pending):
            for flops, _cause in self.pending.pop(key).values():
                self.buckets["unresolved"] += flops


def jain(x: np.ndarray) -> float:
    """Jain's fairness index (1 = perfectly even, 1/n = all on one)."""
    x = np.asarray(x, dtype=float)
    if len(x) == 0 or not np.any(x > 0):
        return 0.0
    return float(x.sum() ** 2 / (len(x) * (x**2).sum()))

"""`CellSpeeds` bounds a freeze's members by the same median `rate_bound` sorts out each time."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from bagel.coordinator.core.roster import CellSpeeds
from bagel.coordinator.core.scheduler import throughput_for

CELL = "k0.r0"


def _naive_median_without(workers: dict[str, Any], wid: str) -> float | None:
    others = sorted(throughput_for(w.throughput, CELL) for x, w in workers.items() if x != wid)
    if not others:
        return None
    n = len(others)
    return others[n // 2] if n % 2 else 0.5 * (others[n // 2 - 1] + others[n // 2])


def test_the_median_of_the_others_matches_a_fresh_sort_as_estimates_move() -> None:
    rng = random.Random(3)
    for trial in range(200):
        n = rng.randint(1, 40)
        # repeated values (ties), and some workers that never measured this cell (their mean)
        pool = [rng.choice([1.0, 2.0, 2.0, 3.5]) if trial % 3 == 0 else rng.uniform(0.1, 50.0) for _ in range(n)]
        workers = {
            f"w{i}": SimpleNamespace(throughput={CELL: v} if i % 7 else {"k1.r0": v, "k2.r0": v * 2})
            for i, v in enumerate(pool)
        }
        roster = SimpleNamespace(workers=workers, changes=SimpleNamespace(ops=0))
        cell = SimpleNamespace(id=CELL, workers=dict.fromkeys(workers))
        speeds = CellSpeeds(roster, cell)  # type: ignore[arg-type]
        for wid in rng.sample(list(workers), k=n):  # a freeze credits each member in turn
            assert speeds.median_without(wid) == _naive_median_without(workers, wid)
            new = rng.uniform(0.1, 50.0) if rng.random() < 0.8 else throughput_for(workers[wid].throughput, CELL)
            workers[wid].throughput[CELL] = new
            speeds.moved(wid, throughput_for(workers[wid].throughput, CELL))
        assert speeds.median_without("not in the cell") == _naive_median_without(workers, "not in the cell")

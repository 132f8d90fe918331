"""Scheduling/round policies: the knobs that make `bagel` differ from the baselines.

The daemon always runs `BAGEL`. The simulator runs the same core under other policies to
compare them side by side:

- `bagel`: throughput-proportional batches (so H inner steps take about the same wall
  time on every card), a deadline that freezes the contributors that are ready, leases
  that drop a dead member from its open round at once, late join (a worker that comes
  to hold the round's base state while it trains is admitted with a share of the time
  left), and exchange parts sized by the uplinks the peers measured;
- `diloco_wait_all`: DiLoCo (Douillard et al., 2023) with equal batches; a round waits for
  every member, a dead member is noticed only when the round times out;
- `sync_dp`: synchronous data parallel: one inner step per round (H = 1), equal batches,
  everyone waits for the slowest.

Run-level values (quorum, lease, min_round_s, ...) stay in the run spec; a Policy only
overrides what a baseline needs to change, and holds the core's tuning constants.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True, slots=True)
class Policy:
    name: str = "bagel"
    # per-member batch: proportional to throughput, or equal shares of diloco.group_batch.
    batch_split: Literal["proportional", "equal"] = "proportional"
    # True: a round freezes only when every live member is ready; its deadline is a
    # timeout that aborts (and re-runs) the round instead of freezing the ready ones.
    wait_for_all: bool = False
    # True: a member whose lease expires leaves its open round at once. False: it stays
    # counted as a member until the round's deadline (a baseline waiting on a timeout).
    fail_fast_leases: bool = True
    # Workers that hold a round's base state but did not train it (a joiner that synced
    # mid-round, a member not ready at the freeze) join the exchange with zero weight and
    # apply the same outer step. Without this a joiner would chase the cell forever: the
    # next round opens the moment a round commits, so any download ends one commit late.
    catch_up: bool = True
    # A worker that comes to hold a round's base state while the round trains (a download
    # that finished after the round opened) is admitted into it with a batch sized to the
    # time left, if at least `late_join_min_share` of the round's training time is left
    # (`scheduler.plan_late_member`); otherwise it waits for the next round.
    late_join: bool = True
    late_join_min_share: float = 0.2
    # exchange parts: sized by each contributor's uplink as the others measured it
    # (`scheduler.part_weights`), or equal (the butterfly as DiLoCo implementations cut it)
    part_split: Literal["measured", "equal"] = "measured"
    # Once this share of a round's live members is ready, the rest get only as long as
    # waiting for them costs the ready ones what their own work is worth (`Rounds.
    # check_freeze`), then the round freezes without them; 0 waits for all (to the deadline).
    patience_share: float = 0.75
    # overrides of the spec (None = use spec.schedule.deadline_slack / spec.diloco.inner_steps)
    deadline_slack: float | None = None
    inner_steps: int | None = None
    # moves between cells at round boundaries and on join/leave (False: place joiners only)
    rebalance: bool = True
    # bounds that keep one transition cheap with 10k workers (see scheduler.repair)
    max_moves_per_event: int = 4
    repair_candidates: int = 32
    swap_candidates: int = 16  # pairs of these are tried when no single move helps
    # no moves are looked for while every cell's share/target ratio is within 1 +- this
    balance_tolerance: float = 0.05
    # SWARM's PerformanceEMA: estimate <- (1 - alpha) * estimate + alpha * observed
    throughput_ema: float = 0.3
    # communication estimate: a worker that reports no bandwidth is taken to have this
    default_bandwidth_bytes_per_s: float = 12.5e6  # 100 Mbit/s
    comm_overhead_s: float = 1.0  # matchmaking and latency per exchange
    # reputation changes; banned at spec.schedule.ban_reputation
    rep_missed_deadline: float = -1.0
    rep_bad_hash: float = -2.0
    rep_failed_report: float = -0.5
    rep_commit: float = 0.25
    rep_max: float = 5.0

    def __post_init__(self) -> None:
        if self.batch_split not in ("proportional", "equal"):
            raise ValueError(f"batch_split: {self.batch_split!r} is not proportional|equal")
        if self.part_split not in ("measured", "equal"):
            raise ValueError(f"part_split: {self.part_split!r} is not measured|equal")
        if self.deadline_slack is not None and self.deadline_slack < 1.0:
            raise ValueError("deadline_slack: at least 1")
        if self.inner_steps is not None and self.inner_steps < 1:
            raise ValueError("inner_steps: at least 1")
        if not 0.0 < self.throughput_ema <= 1.0:
            raise ValueError("throughput_ema: in (0, 1]")
        if self.max_moves_per_event < 0 or self.repair_candidates < 1 or self.swap_candidates < 0:
            raise ValueError("max_moves_per_event >= 0, repair_candidates >= 1, swap_candidates >= 0")
        if not 0.0 <= self.patience_share < 1.0:
            raise ValueError("patience_share: in [0, 1)")
        if not 0.0 <= self.late_join_min_share < 1.0:
            raise ValueError("late_join_min_share: in [0, 1)")
        if self.default_bandwidth_bytes_per_s <= 0:
            raise ValueError("default_bandwidth_bytes_per_s: positive")


BAGEL = Policy()
DILOCO_WAIT_ALL = Policy(
    name="diloco_wait_all",
    batch_split="equal",
    wait_for_all=True,
    fail_fast_leases=False,
    deadline_slack=10.0,
    late_join=False,
    patience_share=0.0,
    part_split="equal",
)
SYNC_DP = replace(DILOCO_WAIT_ALL, name="sync_dp", inner_steps=1)

POLICIES: dict[str, Policy] = {p.name: p for p in (BAGEL, DILOCO_WAIT_ALL, SYNC_DP)}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None

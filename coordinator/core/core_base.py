"""Shared fields of the coordinator core's parts.

`CoordinatorState` (state.py: events, queries, restore) is assembled from two parts with
one set of fields: `Membership` (membership.py: workers, leases, placement, reputation)
and `RoundLifecycle` (rounds.py: open, freeze, commit, abort). This base declares those
fields once, plus the few methods each part calls on the other, so every part reads and
type-checks on its own.
"""

from __future__ import annotations

import heapq
import itertools
import random
from typing import Any

from bagel.coordinator.core.records import CommitRecord
from bagel.coordinator.core.entities import Cell, Round, Worker
from bagel.coordinator.core.policy import Policy
from bagel.coordinator.core.scheduler import Balance, Knobs
from bagel.protocol.runspec import RunSpec

TRAIN_DEADLINE, REDUCE_DEADLINE = "train", "reduce"


class CoreBase:
    spec: RunSpec
    policy: Policy
    rng: random.Random
    knobs: Knobs
    balance: Balance
    now_ms: int
    ops: int  # loop iterations outside the O(1) paths (complexity tests count them)
    max_workers: int | None

    _cells: dict[str, Cell]
    _workers: dict[str, Worker]
    _standby: dict[str, None]  # active workers with no cell (ordered set)
    _active: int
    _leases: list[tuple[int, str]]  # (expiry, worker) heap, lazily deleted
    _deadlines: list[tuple[int, int, str, int, int, str, int]]  # (at, seq, cell, round, attempt, kind, reduce_attempt)
    _seq: itertools.count[int]
    _lease_ms: int
    _min_round_ms: int
    _slack: float
    _quorum: float

    # records changed by the current transition (ordered sets), turned into effects
    _dw: dict[str, None]
    _dc: dict[str, None]
    _dr: dict[tuple[str, int, int], Round]
    _new_commits: list[CommitRecord]

    def _push_deadline(self, at_ms: int, r: Round, kind: str) -> None:
        heapq.heappush(self._deadlines, (at_ms, next(self._seq), r.cell, r.round, r.attempt, kind, r.reduce_attempt))

    # ---- implemented by RoundLifecycle (rounds.py)
    def _drop_member(self, c: Cell, r: Round, wid: str, now: int) -> None:
        raise NotImplementedError

    def _end_round(self, c: Cell, r: Round, now: int, state: Any, reason: str) -> None:
        raise NotImplementedError

    # ---- implemented by Membership (membership.py)
    def _rebalance(self, now: int, *, balance: bool = True) -> None:
        raise NotImplementedError

    def _reputation(self, w: Worker, delta: float, now: int, why: str) -> None:
        raise NotImplementedError

    def _observe_progress(self, w: Worker, c: Cell, r: Round, now: int) -> None:
        raise NotImplementedError

    def _check_orphan(self, c: Cell, now: int) -> None:
        raise NotImplementedError

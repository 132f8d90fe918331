"""The coordinator's pure state machine: workers, leases, cells, outer rounds, commits.

API skeleton (behaviour lands in the next commits). See the module docstring of the
finished file for the lifecycle; the public surface is:

    state = CoordinatorState(spec, cells, policy=BAGEL, rng=random.Random(0), now_ms=0)
    out = state.apply(now_ms, event)        # the one entry point for every transition
    state.instruction_for(worker_id, now_ms) # current order of a worker, no transition
    state.snapshot()                        # every current record
    CoordinatorState.restore(spec, cells, snapshot_or_records..., now_ms=...)
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence

from bagel.coordinator.domain import (
    CellConfig,
    CellRecord,
    CommitRecord,
    Event,
    Instruction,
    Outcome,
    RoundRecord,
    Snapshot,
    WorkerRecord,
)
from bagel.coordinator.policy import BAGEL, Policy
from bagel.coordinator.spec import RunSpec


class CoordinatorState:
    """All of the coordinator's decisions, as a deterministic function of its inputs.

    No I/O, no clock, no global RNG: `now_ms` (unix ms) and the `rng` are arguments.
    Every transition goes through `apply(now_ms, event)`, which validates first and mutates
    after, so an event that raises a `CoordinatorError` leaves the state unchanged.
    """

    def __init__(
        self,
        spec: RunSpec,
        cells: Sequence[CellConfig],
        *,
        policy: Policy = BAGEL,
        rng: random.Random | None = None,
        now_ms: int = 0,
        max_workers: int | None = None,
    ) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ transitions

    def apply(self, now_ms: int, event: Event) -> Outcome:
        """Apply one event at time `now_ms`; returns the caller's instruction, verdict,
        lease, and the durable records that changed (`Outcome.effects`)."""
        raise NotImplementedError

    # ------------------------------------------------------------ queries (no transition)

    def instruction_for(self, worker_id: str, now_ms: int | None = None) -> Instruction:
        """The instruction the worker would get now (O(1)); UnknownWorker if not active."""
        raise NotImplementedError

    def next_wakeup_ms(self) -> int | None:
        """Earliest time a Tick may change something (a lease or a deadline), or None."""
        raise NotImplementedError

    def committed_hash_of(self, cell_id: str, round: int) -> str | None:
        """Hash of a recent committed round of a cell (None if unknown / not kept)."""
        raise NotImplementedError

    def check_upload(self, worker_id: str, cell_id: str, round: int, state_hash: str) -> None:
        """Raise unless `worker_id` may upload the checkpoint of (cell, round, hash)."""
        raise NotImplementedError

    def snapshot(self) -> Snapshot:
        """Every current durable record, sorted by key (restore(snapshot) == self)."""
        raise NotImplementedError

    @classmethod
    def restore(
        cls,
        spec: RunSpec,
        cells: Sequence[CellConfig],
        *,
        workers: Iterable[WorkerRecord],
        cell_records: Iterable[CellRecord],
        rounds: Iterable[RoundRecord],
        commits: Iterable[CommitRecord] = (),
        now_ms: int,
        policy: Policy = BAGEL,
        rng: random.Random | None = None,
        max_workers: int | None = None,
    ) -> CoordinatorState:
        """Rebuild a state from stored records after a restart.

        Active workers get leases renewed to now + lease_s so they can re-attach; open
        (non-terminal) round records continue; terminal ones only inform the history.
        """
        raise NotImplementedError


__all__ = ["CoordinatorState", "Mapping"]

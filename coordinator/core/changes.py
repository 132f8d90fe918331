"""What the current transition changed: the records to persist, and the work it did.

`CoordinatorState.apply` hands every part of the core (`Roster`, `Rounds`) one `Changes`.
A part that mutates a worker, a cell or a round marks it here; at the end of the
transition the marked entities become frozen records (`Outcome.effects`) for the shell to
write in one SQLite transaction. The sets are ordered (dicts with None values), so the
effects come out in the order things changed, whatever PYTHONHASHSEED is.

`ops` counts loop iterations outside the O(1) paths, so complexity tests can assert that
a heartbeat that changes nothing loops over nothing.
"""

from __future__ import annotations

from bagel.coordinator.core.entities import Round
from bagel.coordinator.core.records import CommitRecord


class Changes:
    __slots__ = ("workers", "cells", "rounds", "commits", "ops")

    def __init__(self) -> None:
        self.workers: dict[str, None] = {}
        self.cells: dict[str, None] = {}
        self.rounds: dict[tuple[str, int, int], Round] = {}
        self.commits: list[CommitRecord] = []
        self.ops = 0

    def worker(self, worker_id: str) -> None:
        self.workers[worker_id] = None

    def cell(self, cell_id: str) -> None:
        self.cells[cell_id] = None

    def round(self, r: Round) -> None:
        self.rounds[r.key] = r

    def commit(self, rec: CommitRecord) -> None:
        self.commits.append(rec)

    def empty(self) -> bool:
        return not (self.workers or self.cells or self.rounds or self.commits)

    def clear(self) -> None:
        """Forget the marks (after the effects were taken, or after a refused event)."""
        self.workers, self.cells, self.rounds, self.commits = {}, {}, {}, []

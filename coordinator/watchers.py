"""Held `WatchInstruction` calls (long polls), and which changes wake them.

A worker learns a new instruction from the answer to one of its own calls. Between its
heartbeats it keeps one `WatchInstruction` open: the coordinator holds the answer until
the worker's instruction may have changed, so a freeze, a commit or an abort reaches every
member about one network latency after it happens instead of at each member's next
heartbeat. It is Consul's blocking query (a known index plus a bounded wait) with the
instruction's tag as the index.

`InstructionWatchers` is only the bookkeeping: at most one held call per worker (a newer
one supersedes it), indexed by the cell its instruction names, and woken by the records a
transition changed. A woken call re-reads its instruction and answers only if the tag
moved, so a spurious wake costs one read; a missed one costs the rest of the wait, no
more, because the worker heartbeats when the wait runs out. Correctness never depends on
a wake. The shell that holds the calls is `CoordinatorApp.watch`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from bagel.coordinator.core.records import WorkerRecord


class Watch:
    """One held call: woken (`event`) when its worker's instruction may have changed."""

    __slots__ = ("worker_id", "cell_id", "event", "superseded")

    def __init__(self, worker_id: str, cell_id: str) -> None:
        self.worker_id = worker_id
        self.cell_id = cell_id
        self.event = asyncio.Event()
        self.superseded = False  # a newer call of the same worker took over: answer now


class InstructionWatchers:
    """The held calls, by worker and by cell (see the module docstring)."""

    def __init__(self) -> None:
        self._by_worker: dict[str, Watch] = {}
        self._by_cell: dict[str, dict[str, Watch]] = {}
        self.closed = False

    def __len__(self) -> int:
        return len(self._by_worker)

    def arm(self, worker_id: str, cell_id: str) -> Watch:
        """Hold a call of `worker_id`, whose instruction names `cell_id` ("" = none). A call
        of the same worker already held is superseded (woken to answer at once): a worker
        has at most one, so the held calls are bounded by the active workers."""
        old = self._by_worker.get(worker_id)
        if old is not None:
            old.superseded = True
            old.event.set()
            self.disarm(old)
        w = Watch(worker_id, cell_id)
        if self.closed:
            w.event.set()
            return w
        self._by_worker[worker_id] = w
        self._by_cell.setdefault(cell_id, {})[worker_id] = w
        return w

    def move(self, w: Watch, cell_id: str) -> None:
        """Index `w` under the cell its instruction names now."""
        if cell_id == w.cell_id or self._by_worker.get(w.worker_id) is not w:
            return
        self._drop_from_cell(w)
        w.cell_id = cell_id
        self._by_cell.setdefault(cell_id, {})[w.worker_id] = w

    def disarm(self, w: Watch) -> None:
        if self._by_worker.get(w.worker_id) is w:
            del self._by_worker[w.worker_id]
            self._drop_from_cell(w)

    def _drop_from_cell(self, w: Watch) -> None:
        held = self._by_cell.get(w.cell_id)
        if held is not None and held.get(w.worker_id) is w:
            del held[w.worker_id]
            if not held:
                del self._by_cell[w.cell_id]

    def notify(self, effects: Iterable[object]) -> int:
        """Wake the calls a transition's records may concern: a changed worker's own, and
        every call whose instruction names a cell one of the records belongs to (a round,
        a cell's committed state, a commit). Returns how many were woken.

        A record of no cell (a worker unassigned, registering into standby) wakes no one
        but its own worker: an instruction that names no cell changes only with its own
        worker's record, and waking every standby worker's call on each such record made
        a registration storm quadratic (at 10,000 standby workers the coordinator spent
        its time re-reading instructions that had not changed)."""
        woken = 0
        cells: set[str] = set()
        for rec in effects:
            if isinstance(rec, WorkerRecord):
                w = self._by_worker.get(rec.worker_id)
                if w is not None and not w.event.is_set():
                    w.event.set()
                    woken += 1
                if rec.cell_id:
                    cells.add(rec.cell_id)
            else:
                cid = getattr(rec, "cell_id", None)
                if isinstance(cid, str) and cid:
                    cells.add(cid)
        for cid in cells:
            for w in self._by_cell.get(cid, {}).values():
                if not w.event.is_set():
                    w.event.set()
                    woken += 1
        return woken

    def close(self) -> None:
        """Answer every held call now, and every later one at once (shutting down)."""
        self.closed = True
        for w in self._by_worker.values():
            w.event.set()

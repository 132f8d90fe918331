"""`EventFeed`: what happened in the run, as a bounded list of events and as the daemon's log.

The pure core returns durable records (`Outcome.effects`), not a story; this shell object
reads them after each transition and derives the events an operator wants to hear about:

- `join` / `rejoin`  a worker became active (new, or back after a lost lease or a leave);
- `leave`            it left, with its reason;
- `lost`             its lease ran out;
- `ban`              it was banned, with the reason (reputation, a conviction, ...);
- `move`             an active worker was placed in another cell (feed only, DEBUG log);
- `commit`           a round committed (feed, DEBUG log; INFO once a minute, per cell);
- `abort`            a round attempt aborted, with the reason;
- `rollback`         a cell fell back to its checkpoint (nobody live held its committed
  state when a worker needed it): the rounds since are trained again, in a new epoch;
- `unstaffed`        a cell lost its last member, or has had none for `UNSTAFFED_GRACE_S`
  while workers are active (the case of 2 workers on 5 cells, where 3 never train);
- `staffed`          a cell without members got one again.

A worker's previous (state, cell) is kept per worker (like `WorkerTally`), so a record
that repeats an unchanged state says nothing. Commits and aborts are deduplicated by
their round key. The same events feed the daemon's log and the dashboard
(`bagel.coordinator.dashboard`), so both tell one story.

Bounds: the feed keeps the last `capacity` events; the log prints at most
`LOG_BURST` lines of each kind per `SUMMARY_PERIOD_S` window and counts the rest, which
the once-a-minute summary reports ("not logged: 980 join"). `health_line` is the
one-line summary the daemon logs every `--health-log-s` seconds, like torchft's
"[n/m participants healthy]": n = active workers, m = active + lost (those the run still
expects back; left and banned ones are not counted).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from bagel.coordinator.core.records import (
    CellRecord,
    CommitRecord,
    Record,
    RoundRecord,
    RoundState,
    WorkerRecord,
    WorkerState,
)

log = logging.getLogger("bagel.coordinator.events")

DEFAULT_CAPACITY = 500  # events kept for the dashboard
SUMMARY_PERIOD_S = 60.0  # the per-cell commit summary ("commits per cell per minute")
DEFAULT_HEALTH_PERIOD_S = 30.0  # `serve --health-log-s`
UNSTAFFED_CHECK_S = 5.0  # how often cells without members are looked for
UNSTAFFED_GRACE_S = 10.0  # ... and how long one stays empty, with workers active, before it is reported
LOG_BURST = 20  # lines of one kind per summary window before the rest are only counted
NAMES_SHOWN = 12  # cells named in one log line before "and N more"

# the log level of each kind (the feed keeps them all)
_LEVELS = {
    "join": logging.INFO,
    "rejoin": logging.INFO,
    "leave": logging.INFO,
    "lost": logging.INFO,
    "ban": logging.WARNING,
    "move": logging.DEBUG,
    "commit": logging.DEBUG,
    "abort": logging.INFO,
    "rollback": logging.WARNING,
    "unstaffed": logging.WARNING,
    "staffed": logging.INFO,
}


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """One thing that happened: `seq` grows by one per event (the dashboard's cursor)."""

    seq: int
    at_ms: int
    kind: str
    text: str
    cell_id: str = ""
    worker_id: str = ""
    round: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "seq": self.seq,
            "at_ms": self.at_ms,
            "kind": self.kind,
            "text": self.text,
            "cell_id": self.cell_id,
            "worker_id": self.worker_id,
            "round": self.round,
        }


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:NAMES_SHOWN])
    return shown + (f" and {len(items) - NAMES_SHOWN} more" if len(items) > NAMES_SHOWN else "")


def _who(rec: WorkerRecord) -> str:
    name = rec.profile.name
    # names come from the worker's own profile: shown, but clipped and never trusted as markup
    return f"{rec.worker_id} ({name[:32]})" if name else rec.worker_id


class EventFeed:
    """The run's events, derived from the core's records (see the module docstring)."""

    def __init__(
        self,
        cell_ids: Iterable[str],
        workers: Iterable[WorkerRecord] = (),
        cells: Iterable[CellRecord] = (),
        *,
        capacity: int = DEFAULT_CAPACITY,
        logger: logging.Logger = log,
    ) -> None:
        self.cell_ids = tuple(cell_ids)
        self.events: collections.deque[FeedEvent] = collections.deque(maxlen=capacity)
        self.seq = 0
        self.log = logger
        self._workers: dict[str, tuple[WorkerState, str]] = {}
        self._members: dict[str, set[str]] = {c: set() for c in self.cell_ids}
        for rec in workers:
            self._workers[rec.worker_id] = (rec.state, rec.cell_id)
            if rec.state is WorkerState.ACTIVE and rec.cell_id in self._members:
                self._members[rec.cell_id].add(rec.worker_id)
        self._aborted: dict[str, tuple[int, int]] = {}  # cell -> last aborted (round, attempt)
        self._committed: dict[str, int] = {}  # cell -> last committed round seen
        self._epochs: dict[str, int] = {}  # cell -> its rollbacks count seen
        for cell in cells:
            self._committed[cell.cell_id] = cell.committed_round
            self._epochs[cell.cell_id] = cell.rollbacks
        self._unstaffed_said: set[str] = set()  # cells whose current streak without members was reported
        self._empty_since: dict[str, int] = {}  # cell -> first check that found it empty with workers active
        # the summary window
        self._window_commits: collections.Counter[str] = collections.Counter()
        self._window_last: dict[str, CommitRecord] = {}
        self._window_aborts: collections.Counter[str] = collections.Counter()
        self._window_reasons: dict[str, collections.Counter[str]] = {}
        self._logged: collections.Counter[str] = collections.Counter()
        self._suppressed: collections.Counter[str] = collections.Counter()
        self._period_commits = 0  # since the last health line
        self._period_aborts = 0

    # ------------------------------------------------------------------ input

    def record(self, effects: Iterable[Record], now_ms: int) -> None:
        """Derive the events of one transition's effects (called after every apply with effects)."""
        touched: set[str] = set()
        for rec in effects:
            if isinstance(rec, WorkerRecord):
                self._on_worker(rec, now_ms, touched)
            elif isinstance(rec, CommitRecord):
                self._on_commit(rec, now_ms)
            elif isinstance(rec, RoundRecord) and rec.state is RoundState.ABORTED:
                self._on_abort(rec, now_ms)
            elif isinstance(rec, CellRecord) and rec.rollbacks > self._epochs.get(rec.cell_id, 0):
                self._on_rollback(rec, now_ms)
        for cell in sorted(touched):
            n = len(self._members[cell])
            if n == 0:
                self._unstaffed_said.add(cell)
                self._emit(now_ms, "unstaffed", f"cell {cell} has no members: it trains nothing", cell_id=cell)
            elif cell in self._unstaffed_said:
                self._unstaffed_said.discard(cell)
                self._emit(now_ms, "staffed", f"cell {cell} has members again ({n})", cell_id=cell)

    def _on_worker(self, rec: WorkerRecord, now_ms: int, touched: set[str]) -> None:
        wid = rec.worker_id
        old = self._workers.get(wid)
        new = (rec.state, rec.cell_id)
        if old == new:
            return
        self._workers[wid] = new
        old_state, old_cell = old if old is not None else (None, "")
        was_member = old_state is WorkerState.ACTIVE and old_cell in self._members
        is_member = rec.state is WorkerState.ACTIVE and rec.cell_id in self._members
        if was_member and (not is_member or old_cell != rec.cell_id):
            self._members[old_cell].discard(wid)
            if not self._members[old_cell]:
                touched.add(old_cell)
        if is_member and (not was_member or old_cell != rec.cell_id):
            if not self._members[rec.cell_id]:
                touched.add(rec.cell_id)
            self._members[rec.cell_id].add(wid)
        who = _who(rec)
        where = f" -> cell {rec.cell_id}" if rec.cell_id else " (standby)"
        if rec.state is WorkerState.ACTIVE:
            if old_state is None:
                self._emit(now_ms, "join", f"{who} joined{where}", worker_id=wid, cell_id=rec.cell_id)
            elif old_state is not WorkerState.ACTIVE:
                self._emit(now_ms, "rejoin", f"{who} is back{where}", worker_id=wid, cell_id=rec.cell_id)
            elif rec.cell_id and rec.cell_id != old_cell:
                frm = f"cell {old_cell}" if old_cell else "standby"
                self._emit(now_ms, "move", f"{who} moved from {frm}{where}", worker_id=wid, cell_id=rec.cell_id)
            return
        reason = f": {rec.reason}" if rec.reason else ""
        cell = old_cell or rec.cell_id
        if rec.state is WorkerState.LOST:
            self._emit(now_ms, "lost", f"{who} lost its lease{reason}", worker_id=wid, cell_id=cell)
        elif rec.state is WorkerState.LEFT:
            self._emit(now_ms, "leave", f"{who} left{reason}", worker_id=wid, cell_id=cell)
        elif rec.state is WorkerState.BANNED and old_state is not WorkerState.BANNED:
            self._emit(now_ms, "ban", f"{who} banned{reason}", worker_id=wid, cell_id=cell)

    def _on_commit(self, rec: CommitRecord, now_ms: int) -> None:
        if self._committed.get(rec.cell_id, -1) >= rec.round:
            return
        self._committed[rec.cell_id] = rec.round
        self._window_commits[rec.cell_id] += 1
        self._window_last[rec.cell_id] = rec
        self._period_commits += 1
        heldout = f", held-out {rec.heldout_loss:.4f}" if rec.heldout_loss >= 0 else ""
        self._emit(
            now_ms,
            "commit",
            f"cell {rec.cell_id} committed round {rec.round} ({len(rec.agreeing)}/{len(rec.contributors)} agreed,"
            f" {rec.samples} samples, loss {rec.loss:.4f}{heldout})",
            cell_id=rec.cell_id,
            round=rec.round,
        )

    def _on_rollback(self, rec: CellRecord, now_ms: int) -> None:
        self._epochs[rec.cell_id] = rec.rollbacks
        lost = self._committed.get(rec.cell_id, rec.committed_round)
        # the rounds after the checkpoint are committed again: their commits are news again
        self._committed[rec.cell_id] = rec.committed_round
        what = f"round {rec.committed_round}, its checkpoint" if rec.committed_round else "its initial state"
        rounds = f"; rounds {rec.committed_round + 1}..{lost} are lost" if lost > rec.committed_round else ""
        self._emit(
            now_ms,
            "rollback",
            f"cell {rec.cell_id} fell back to {what}: no live worker held its committed state{rounds}",
            cell_id=rec.cell_id,
            round=rec.committed_round,
        )

    def _on_abort(self, rec: RoundRecord, now_ms: int) -> None:
        key = (rec.round, rec.attempt)
        if self._aborted.get(rec.cell_id) == key:
            return
        self._aborted[rec.cell_id] = key
        reason = rec.reason or "no reason recorded"
        self._window_aborts[rec.cell_id] += 1
        self._window_reasons.setdefault(rec.cell_id, collections.Counter())[reason] += 1
        self._period_aborts += 1
        self._emit(
            now_ms,
            "abort",
            f"cell {rec.cell_id} round {rec.round} attempt {rec.attempt} aborted: {reason}",
            cell_id=rec.cell_id,
            round=rec.round,
        )

    def _emit(
        self, now_ms: int, kind: str, text: str, *, cell_id: str = "", worker_id: str = "", round: int = 0
    ) -> None:
        self.seq += 1
        self.events.append(FeedEvent(self.seq, now_ms, kind, text, cell_id, worker_id, round))
        level = _LEVELS.get(kind, logging.INFO)
        if not self.log.isEnabledFor(level):
            return
        if self._logged[kind] >= LOG_BURST:
            self._suppressed[kind] += 1
            return
        self._logged[kind] += 1
        self.log.log(level, "%s", text)

    # ------------------------------------------------------------------ output

    def recent(self, limit: int = 100) -> list[FeedEvent]:
        """The last `limit` events, oldest first."""
        n = len(self.events)
        return list(itertools.islice(self.events, max(0, n - limit), n))

    def members(self, cell_id: str) -> int:
        return len(self._members.get(cell_id, ()))

    def unstaffed(self) -> list[str]:
        """Cells no active worker is placed in, in the spec's order."""
        return [c for c in self.cell_ids if not self._members[c]]

    def check_unstaffed(self, active: int, now_ms: int, grace_ms: int) -> None:
        """Emit `unstaffed` (once per streak) for each cell that has had no members for
        `grace_ms` while workers were active: the case where nothing else would say so."""
        if not active:
            self._empty_since.clear()
            return
        for cell in self.cell_ids:
            if self._members[cell]:
                self._empty_since.pop(cell, None)
                continue
            since = self._empty_since.setdefault(cell, now_ms)
            if cell not in self._unstaffed_said and now_ms - since >= grace_ms:
                self._unstaffed_said.add(cell)
                self._emit(
                    now_ms,
                    "unstaffed",
                    f"cell {cell} has had no members for {(now_ms - since) / 1000:.0f} s while {active} workers are"
                    " active: it trains nothing",
                    cell_id=cell,
                )

    def health_line(self, counts: Mapping[str, int], period_s: float) -> str:
        """The one-line health summary; resets the period's commit and abort counts."""
        active, lost = counts.get("active", 0), counts.get("lost", 0)
        empty = self.unstaffed()
        staffed = len(self.cell_ids) - len(empty)
        parts = [
            f"[{active}/{active + lost} workers healthy]",
            f"{staffed}/{len(self.cell_ids)} cells with members",
        ]
        if empty:
            parts.append(f"no members: {_names(empty)}")
        parts.append(f"standby {counts.get('standby', 0)}")
        if counts.get("banned", 0):
            parts.append(f"banned {counts['banned']}")
        parts.append(f"last {period_s:g} s: {self._period_commits} commits, {self._period_aborts} aborts")
        self._period_commits = self._period_aborts = 0
        return "; ".join(parts)

    def summary_line(self, period_s: float) -> str:
        """Commits (and aborts, with their commonest reason) per cell over the last window;
        resets the window and the log's per-kind budget."""
        done = []
        for cell in self.cell_ids:
            n = self._window_commits.get(cell, 0)
            if n:
                last = self._window_last[cell]
                done.append(f"{cell} {n} (round {last.round}, loss {last.loss:.4f})")
        idle = [c for c in self.cell_ids if not self._window_commits.get(c)]
        parts = [f"commits in the last {period_s:g} s: " + (", ".join(done) if done else "none")]
        if idle and done:
            parts.append(f"nothing committed: {_names(idle)}")
        aborts = []
        for cell in self.cell_ids:
            n = self._window_aborts.get(cell, 0)
            if n:
                reason, times = self._window_reasons[cell].most_common(1)[0]
                aborts.append(f"{cell} {n} ({reason}" + (f" x{times})" if n > 1 else ")"))
        if aborts:
            parts.append("aborts: " + ", ".join(aborts))
        if self._suppressed:
            parts.append("not logged: " + ", ".join(f"{n} {k}" for k, n in sorted(self._suppressed.items())))
        self._window_commits.clear()
        self._window_last.clear()
        self._window_aborts.clear()
        self._window_reasons.clear()
        self._logged.clear()
        self._suppressed.clear()
        return "; ".join(parts)


async def log_loop(
    feed: EventFeed,
    counts: Callable[[], Mapping[str, int]],
    clock: Callable[[], int],
    *,
    health_period_s: float | None = DEFAULT_HEALTH_PERIOD_S,
    summary_period_s: float = SUMMARY_PERIOD_S,
    check_period_s: float = UNSTAFFED_CHECK_S,
) -> None:
    """The daemon's periodic story (a task, cancelled on stop): `feed.health_line` every
    `health_period_s` (None or 0: never), `feed.summary_line` every `summary_period_s`, and
    every `check_period_s` the check for cells left without members for `UNSTAFFED_GRACE_S`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    next_health = start + health_period_s if health_period_s else float("inf")
    next_summary = start + summary_period_s
    while True:
        await asyncio.sleep(max(0.0, min(next_health, next_summary, loop.time() + check_period_s) - loop.time()))
        now = loop.time()
        try:
            c = counts()
            feed.check_unstaffed(c.get("active", 0), clock(), int(UNSTAFFED_GRACE_S * 1000))
            if health_period_s and now >= next_health:
                next_health = now + health_period_s
                feed.log.info("%s", feed.health_line(c, health_period_s))
            if now >= next_summary:
                next_summary = now + summary_period_s
                feed.log.info("%s", feed.summary_line(summary_period_s))
        except Exception:  # the story must never stop the run
            log.exception("event log summary failed")

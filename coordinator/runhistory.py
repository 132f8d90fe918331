"""`RunHistory`: the dashboard's time series, derived from the core's events and effects.

- **throughput**: samples the workers reported training (`ReportRound.samples` of the
  reports the core accepted, each (worker, cell, round, exchange attempt) counted once),
  per second, spread over the time the report says it trained (`compute_ms`, which ended
  `comm_ms` before the report), so a round's samples do not all land at its end;
- **goodput**: samples in committed rounds (`CommitRecord.samples`), per second, spread
  over the committed attempt's life (opened to committed): what survived into the model;
  throughput minus goodput is the work that was aborted, refused, or reported by a straggler;
- per cell, its commit curve: (round, mean training loss, median held-out loss, when,
  bytes the contributors sent in the committed round's exchanges).

Bounds: the time series holds at most `max_points` buckets; when it would hold more, each
pair of neighbours is merged and the bucket width doubles, so the chart always covers the
whole run at a resolution that coarsens as it grows. Each cell keeps its last
`curve_points` commits. The daemon's memory for this is O(cells * curve_points + max_points).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass

from bagel.coordinator.core.events import Event, ReportRound
from bagel.coordinator.core.records import CommitRecord, Record, RoundRecord

DEFAULT_BUCKET_MS = 2000
DEFAULT_MAX_POINTS = 360
DEFAULT_CURVE_POINTS = 240
MAX_SPREAD_MS = 6 * 3600 * 1000  # a reported duration is the worker's word: clamped to this


@dataclass(slots=True)
class Bucket:
    """Samples trained and committed in [start_ms, start_ms + the history's bucket width)."""

    start_ms: int
    trained: float = 0.0
    committed: float = 0.0


@dataclass(frozen=True, slots=True)
class CommitPoint:
    round: int
    loss: float
    heldout_loss: float  # -1 = not measured
    committed_ms: int
    bytes_sent: int  # summed over the reports of the round (every exchange attempt)


class RunHistory:
    """Throughput, goodput and per-cell commit curves (see the module docstring)."""

    def __init__(
        self,
        cell_ids: Iterable[str],
        *,
        bucket_ms: int = DEFAULT_BUCKET_MS,
        max_points: int = DEFAULT_MAX_POINTS,
        curve_points: int = DEFAULT_CURVE_POINTS,
        start_ms: int | None = None,
    ) -> None:
        if bucket_ms <= 0 or max_points < 2:
            raise ValueError("bucket_ms must be positive and max_points at least 2")
        self.bucket_ms = bucket_ms
        self.max_points = max_points
        self.buckets: list[Bucket] = []
        self.curves: dict[str, collections.deque[CommitPoint]] = {
            c: collections.deque(maxlen=curve_points) for c in cell_ids
        }
        # per cell: the round whose reports are being summed, the reports counted, bytes so far
        self._round: dict[str, int] = {}
        self._seen: dict[str, set[tuple[str, int]]] = {}
        self._bytes: dict[str, int] = {}
        self.trained_total = 0
        self.committed_total = 0
        if start_ms is not None:  # the series begins here (the daemon's start), not at the first report
            self.advance(start_ms)

    def record(self, event: Event, effects: Iterable[Record], now_ms: int) -> None:
        """Called after every transition with effects (the report was accepted)."""
        if isinstance(event, ReportRound) and event.cell_id in self.curves:
            cell = event.cell_id
            if self._round.get(cell) != event.round:
                self._round[cell], self._seen[cell], self._bytes[cell] = event.round, set(), 0
            key = (event.worker_id, event.reduce_attempt)
            if key not in self._seen[cell] and len(self._seen[cell]) < 4096:
                self._seen[cell].add(key)
                self._bytes[cell] += max(0, event.bytes_sent)
                if not event.failed and event.samples > 0:
                    comm = min(max(0, event.comm_ms), MAX_SPREAD_MS)
                    compute = min(max(0, event.compute_ms), MAX_SPREAD_MS)
                    self.trained_total += event.samples
                    self._spread(now_ms - comm - compute, now_ms - comm, now_ms, trained=event.samples)
        effects = tuple(effects)
        commits = [r for r in effects if isinstance(r, CommitRecord)]
        if not commits:
            return
        opened = {(r.cell_id, r.round, r.attempt): r.opened_ms for r in effects if isinstance(r, RoundRecord)}
        for rec in commits:
            if rec.cell_id in self.curves:
                curve = self.curves[rec.cell_id]
                if curve and curve[-1].round >= rec.round:
                    continue
                sent = self._bytes.get(rec.cell_id, 0) if self._round.get(rec.cell_id) == rec.round else 0
                curve.append(CommitPoint(rec.round, rec.loss, rec.heldout_loss, rec.committed_ms, sent))
                self.committed_total += rec.samples
                start = opened.get((rec.cell_id, rec.round, rec.attempt), now_ms)
                self._spread(max(start, now_ms - MAX_SPREAD_MS), now_ms, now_ms, committed=rec.samples)

    def _spread(self, start_ms: int, end_ms: int, now_ms: int, *, trained: int = 0, committed: int = 0) -> None:
        """Add samples to the buckets that [start_ms, end_ms] overlaps, in proportion (an
        empty interval is one instant). Time before the first bucket (work done before this
        history began: a restart) is left out of the series; the totals count it."""
        self.advance(now_ms)
        end = min(end_ms, now_ms)
        start = min(start_ms, end)
        if end == start:
            end += 1
        total = end - start
        for b in reversed(self.buckets):
            lo, hi = b.start_ms, b.start_ms + self.bucket_ms
            if hi <= start:
                break
            overlap = min(hi, end) - max(lo, start)
            if overlap > 0:
                b.trained += trained * overlap / total
                b.committed += committed * overlap / total

    def advance(self, now_ms: int) -> None:
        """Extend the series to `now_ms` (empty buckets for the quiet time in between)."""
        start = now_ms - now_ms % self.bucket_ms
        if not self.buckets:
            self.buckets.append(Bucket(start))
            return
        last = self.buckets[-1].start_ms
        if start <= last:
            return
        # at most a full chart of empty buckets: a longer silence shows as max_points zeros
        first = max(last + self.bucket_ms, start - self.bucket_ms * (self.max_points - 1))
        self.buckets.extend(Bucket(t) for t in range(first, start + 1, self.bucket_ms))
        while len(self.buckets) > self.max_points:
            self._coarsen()

    def _coarsen(self) -> None:
        self.bucket_ms *= 2
        merged: list[Bucket] = []
        for b in self.buckets:
            start = b.start_ms - b.start_ms % self.bucket_ms
            if merged and merged[-1].start_ms == start:
                merged[-1].trained += b.trained
                merged[-1].committed += b.committed
            else:
                merged.append(Bucket(start, b.trained, b.committed))
        self.buckets = merged

    def series(self, now_ms: int) -> dict[str, list[float]]:
        """Complete buckets only (the current one is still filling): start times and rates."""
        self.advance(now_ms)
        done = self.buckets[:-1]
        per_s = 1000.0 / self.bucket_ms
        return {
            "t_ms": [float(b.start_ms) for b in done],
            "throughput": [b.trained * per_s for b in done],
            "goodput": [b.committed * per_s for b in done],
        }

    def curve(self, cell_id: str) -> list[CommitPoint]:
        return list(self.curves.get(cell_id, ()))

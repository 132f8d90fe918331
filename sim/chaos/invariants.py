"""Invariant checker for fault-injection runs: a pure function over a recorded history.

`bagel-sim chaos` records what it saw (the coordinator store's commit log read before
and after every coordinator restart, the state hashes members reported or held, the
fault timeline, the processes and ports it started) into a `History`; `check_history`
says which invariants held and, for each one that did not, exactly why. Being a pure
function of plain data, it is tested with doctored histories: a checker that cannot
fail is worthless.

Invariants (the names are the keys of the chaos `summary.json`):

- `no_committed_round_lost`: a (cell, epoch, round) committed in an earlier read of the
  commit log is present, with the same hash, in every later read (e.g. after a SIGKILL
  and restart of the coordinator); and every commit acknowledged to a worker
  (VERDICT_COMMITTED) is in the final log with that hash.
  Epochs: an orphaned cell falls back to its last checkpoint by design and re-commits the
  rounds after it in the next epoch (`CellRecord.rollbacks`; the store keys commits by
  (cell, epoch, round) and reads back the current epoch). A later read whose cell is in a
  newer epoch starting at round b + 1 drops the older epoch's rounds above b: those are
  rolled back, which is allowed for at most `max_rollback_rounds` rounds per rollback
  (the checkpoint interval; default 0: any rollback is a lost commit). Without epochs
  (all 0) a rollback shows as lost rounds.
- `no_round_applied_twice`: within every read of the log, each (cell, epoch, round)
  appears at most once and a cell's rounds in an epoch are contiguous, from 1 in epoch
  0 (a gap means a round number was skipped or its record lost, a repeat means it was
  applied twice).
- `replicas_bit_identical`: every hash an honest worker reported or held for a committed
  (cell, round) equals the committed hash (after a rollback: the hash committed in one of
  the round's epochs, in any read of the log). Workers declared Byzantine are exempt, and
  their disagreements are listed in `notes`.
- `progress_resumes`: after each fault ends, some cell commits a round within
  `progress_bound_s`; a bound that runs past the end of the history without a commit
  is a violation too (the run did not show recovery).
- `no_process_leaked`: no process the runner started is alive at the end.
- `no_port_leaked`: no port the runner bound is still listening at the end.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CommitEntry:
    cell_id: str
    round: int
    state_hash: str
    committed_s: float = 0.0  # time of the commit, if known
    epoch: int = 0  # the cell's lineage (CellRecord.rollbacks when it was committed)


@dataclass(frozen=True)
class CommitLogRead:
    """The store's commit log as read at `t_s` (`label`: e.g. "before coordinator kill")."""

    t_s: float
    label: str
    commits: tuple[CommitEntry, ...]


@dataclass(frozen=True)
class HashObservation:
    t_s: float
    worker_id: str
    cell_id: str
    round: int
    state_hash: str
    source: str = "report"  # "report" | "local" (held state) | ...


@dataclass(frozen=True)
class FaultRecord:
    t_s: float
    kind: str
    end_s: float | None = None  # None = instantaneous (end = start)
    detail: str = ""

    @property
    def ends_s(self) -> float:
        return self.t_s if self.end_s is None else self.end_s


@dataclass(frozen=True)
class History:
    commit_logs: tuple[CommitLogRead, ...] = ()  # in time order
    acknowledged: tuple[CommitEntry, ...] = ()  # VERDICT_COMMITTED answers workers received
    hashes: tuple[HashObservation, ...] = ()
    faults: tuple[FaultRecord, ...] = ()
    end_s: float = 0.0
    progress_bound_s: float = 60.0
    byzantine_workers: frozenset[str] = frozenset()
    max_rollback_rounds: int = 0  # rounds an orphan rollback may drop (checkpoint interval)
    started_pids: tuple[int, ...] = ()
    alive_pids_at_end: tuple[int, ...] = ()
    bound_ports: tuple[int, ...] = ()
    listening_ports_at_end: tuple[int, ...] = ()


@dataclass(frozen=True)
class InvariantResult:
    name: str
    ok: bool
    violations: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)


NAMES = (
    "no_committed_round_lost",
    "no_round_applied_twice",
    "replicas_bit_identical",
    "progress_resumes",
    "no_process_leaked",
    "no_port_leaked",
)


def _result(name: str, violations: Iterable[str], notes: Iterable[str] = ()) -> InvariantResult:
    v = tuple(violations)
    return InvariantResult(name, not v, v, tuple(notes))


Key = tuple[str, int, int]  # (cell, epoch, round)


def _log_map(read: CommitLogRead) -> dict[Key, str]:
    return {(c.cell_id, c.epoch, c.round): c.state_hash for c in read.commits}


def _epoch_bases(read: CommitLogRead) -> dict[tuple[str, int], int]:
    """(cell, epoch) -> the last round before the epoch's first (its rollback point)."""
    first: dict[tuple[str, int], int] = {}
    for c in read.commits:
        k = (c.cell_id, c.epoch)
        first[k] = min(first.get(k, c.round), c.round)
    return {k: r - 1 for k, r in first.items()}


def check_no_committed_round_lost(h: History) -> InvariantResult:
    out: list[str] = []
    notes: list[str] = []
    logs = sorted(h.commit_logs, key=lambda r: r.t_s)
    allowed: set[tuple[str, int, str]] = set()  # (cell, round, hash) of allowed rollbacks
    for i, earlier in enumerate(logs):
        before = _log_map(earlier)
        for later in logs[i + 1 :]:
            after = _log_map(later)
            newest: dict[str, int] = {}
            for cell, ep, _r in after:
                newest[cell] = max(newest.get(cell, ep), ep)
            bases = _epoch_bases(later)
            rolled: dict[tuple[str, int], list[tuple[int, str]]] = {}
            for key, hsh in sorted(before.items()):
                cell, ep, rnd = key
                if key in after:
                    if after[key] != hsh:
                        out.append(
                            f"{cell} round {rnd}: hash {hsh[:12]} at '{earlier.label}' became "
                            f"{after[key][:12]} at '{later.label}'"
                        )
                    continue
                cur = newest.get(cell, -1)
                if cur > ep:
                    base = bases[(cell, cur)]
                    if rnd <= base:
                        continue  # below the rollback point: kept in the older epoch's rows
                    rolled.setdefault((cell, cur), []).append((rnd, hsh))
                    continue
                out.append(f"{cell} round {rnd}: in the log at '{earlier.label}' but missing at '{later.label}'")
            for (cell, ep), lost in sorted(rolled.items()):
                msg = (
                    f"{cell}: rounds {lost[0][0]}..{lost[-1][0]} rolled back to the checkpoint "
                    f"(epoch {ep}) by '{later.label}'"
                )
                if len(lost) > h.max_rollback_rounds:
                    out.append(f"{msg}: {len(lost)} > {h.max_rollback_rounds} allowed")
                else:
                    notes.append(msg)
                    allowed.update((cell, rnd, hsh) for rnd, hsh in lost)
    final = _log_map(logs[-1]) if logs else {}
    by_round: dict[tuple[str, int], set[str]] = {}
    for (cell, _ep, rnd), hsh in final.items():
        by_round.setdefault((cell, rnd), set()).add(hsh)
    for ack in h.acknowledged:
        key = (ack.cell_id, ack.epoch, ack.round)
        if key in final:
            if final[key] != ack.state_hash:
                out.append(
                    f"{ack.cell_id} round {ack.round}: acknowledged with hash {ack.state_hash[:12]}, "
                    f"final log has {final[key][:12]}"
                )
        elif (ack.cell_id, ack.round, ack.state_hash) in allowed:
            continue  # committed, then rolled back within the bound (noted above)
        elif ack.state_hash not in by_round.get((ack.cell_id, ack.round), set()):
            out.append(f"{ack.cell_id} round {ack.round}: acknowledged as committed but not in the final log")
    return _result("no_committed_round_lost", dict.fromkeys(out), dict.fromkeys(notes))


def check_no_round_applied_twice(h: History) -> InvariantResult:
    out: list[str] = []
    for read in h.commit_logs:
        by_lineage: dict[tuple[str, int], list[int]] = defaultdict(list)
        for c in read.commits:
            by_lineage[(c.cell_id, c.epoch)].append(c.round)
        for (cell, ep), rounds in sorted(by_lineage.items()):
            seen: set[int] = set()
            for r in rounds:
                if r in seen:
                    out.append(f"{cell} round {r}: appears twice in the log at '{read.label}'")
                seen.add(r)
            bad = sorted(r for r in seen if r < 1)
            if bad:
                out.append(f"{cell}: invalid round numbers {bad} in the log at '{read.label}'")
                continue
            lo = 1 if ep == 0 else min(seen)
            missing = sorted(set(range(lo, max(seen) + 1)) - seen)
            if missing:
                out.append(f"{cell}: rounds {missing} missing below round {max(seen)} in the log at '{read.label}'")
    return _result("no_round_applied_twice", out)


def check_replicas_bit_identical(h: History) -> InvariantResult:
    out: list[str] = []
    notes: list[str] = []
    # a (cell, round) may have been committed in several epochs (an orphan rollback and the
    # rounds committed again): a replica that applied any of them agreed with its round's
    # members; whether the rollback itself was allowed is no_committed_round_lost's to say
    committed: dict[tuple[str, int], set[str]] = defaultdict(set)
    for read in h.commit_logs:
        for c in read.commits:
            committed[(c.cell_id, c.round)].add(c.state_hash)
    for ob in h.hashes:
        want = committed.get((ob.cell_id, ob.round))
        if not want or ob.state_hash in want:
            continue
        msg = (
            f"{ob.cell_id} round {ob.round}: {ob.worker_id} {ob.source} hash {ob.state_hash[:12]} "
            f"!= committed {sorted(want)[0][:12]} (t={ob.t_s:.1f}s)"
        )
        (notes if ob.worker_id in h.byzantine_workers else out).append(msg)
    return _result("replicas_bit_identical", out, notes)


def settled_after(commits: Iterable[CommitEntry], last_end: float) -> tuple[set[tuple[str, int]], set[str]]:
    """The (cell, round)s of the commit log committed after `last_end`, and the cells that
    committed before it and not since: what the run waits on before it stops. It reads
    commit times, as `progress_resumes` does, so a stop it allows that invariant accepts."""
    commits = tuple(commits)
    before = {c.cell_id for c in commits if c.committed_s <= last_end}
    after = {(c.cell_id, c.round) for c in commits if c.committed_s > last_end}
    return after, before - {cell for cell, _ in after}


def check_progress_resumes(h: History) -> InvariantResult:
    out: list[str] = []
    final = max(h.commit_logs, key=lambda r: r.t_s).commits if h.commit_logs else ()
    times = sorted(c.committed_s for c in final)
    for f in sorted(h.faults, key=lambda f: f.t_s):
        start = f.ends_s
        limit = start + h.progress_bound_s
        nxt = next((t for t in times if t > start), None)
        if nxt is None or nxt > limit:
            if limit > h.end_s and nxt is None:
                out.append(
                    f"{f.kind} at {f.t_s:.1f}s: no commit after it ended ({start:.1f}s) "
                    f"before the run ended at {h.end_s:.1f}s"
                )
            else:
                late = "none" if nxt is None else f"{nxt - start:.1f}s"
                out.append(f"{f.kind} at {f.t_s:.1f}s: next commit after {late} > bound {h.progress_bound_s:.1f}s")
    return _result("progress_resumes", out)


def check_no_process_leaked(h: History) -> InvariantResult:
    alive = set(h.alive_pids_at_end)
    return _result("no_process_leaked", [f"pid {p} still alive" for p in h.started_pids if p in alive])


def check_no_port_leaked(h: History) -> InvariantResult:
    listening = set(h.listening_ports_at_end)
    return _result("no_port_leaked", [f"port {p} still listening" for p in h.bound_ports if p in listening])


CHECKS = (
    check_no_committed_round_lost,
    check_no_round_applied_twice,
    check_replicas_bit_identical,
    check_progress_resumes,
    check_no_process_leaked,
    check_no_port_leaked,
)


def check_history(h: History) -> dict[str, InvariantResult]:
    """Every invariant, by name (see the module docstring)."""
    return {r.name: r for r in (check(h) for check in CHECKS)}


def summary(results: dict[str, InvariantResult]) -> dict[str, bool]:
    return {name: r.ok for name, r in results.items()}

"""What a chaos run observed, turned into a `sim.invariants.History` and the runner's checks.

Sources, each read from the real parts, never inferred from the schedule:

- worker events (`bagel-worker join --log-json`): `committed` (a commit acknowledged to
  that worker, with the full state hash it applied), `verdict` (and its hash, when the
  worker logs it), `ready` (per-round training loss), `error`, and refusals that say the
  worker is banned;
- the coordinator's commit log: its SQLite store opened read-only (`Store.open_readonly`,
  safe while the daemon runs: WAL readers never block the writer), labelled reads;
- the workers' local checkpoints, one per committed round (`--keep-round-history`), loaded
  with the worker's own loader (`worker/localstate.py`), which re-hashes the tensors;
- the supervisor's record of every pid and listening port (`sim/procs.py`).

`sim/invariants.py` decides on the history (pure function); `runner_checks` adds what only
the runner can know: whether every scheduled fault really fired, and whether any process
ended that the runner did not end.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bagel.protocol.runspec import RunSpec
from bagel.sim.chaos import invariants as inv
from bagel.sim.chaos.supervisor import Supervisor, listening_ports, port_owners
from bagel.sim.faults import Fault, fault_as_dict


@dataclass
class FiredFault:
    """One scheduled fault as it actually happened."""

    index: int
    fault: Fault
    fired_s: float | None = None  # run time (s since the driver started) of the first hit
    ended_s: float | None = None
    targets: list[str] = field(default_factory=list)
    detail: str = ""
    error: str = ""

    def as_dict(self, t_zero: float | None) -> dict[str, Any]:
        def rel(t: float | None) -> float | None:
            return None if t is None or t_zero is None else round(t - t_zero, 3)

        return {
            "index": self.index,
            "scheduled": fault_as_dict(self.fault),
            "kind": self.fault.kind.value,
            "fired": self.fired_s is not None and not self.error,
            "at_s": rel(self.fired_s),
            "end_s": rel(self.ended_s),
            "run_time_s": None if self.fired_s is None else round(self.fired_s, 3),
            "targets": self.targets,
            "detail": self.detail,
            "error": self.error,
        }


@dataclass
class Observations:
    """What the workers said (--log-json), in driver run time."""

    acknowledged: list[inv.CommitEntry] = field(default_factory=list)
    hashes: list[inv.HashObservation] = field(default_factory=list)
    ready_loss: list[tuple[float, int, str, int, float]] = field(default_factory=list)  # t, worker, cell, round, loss
    verdicts: dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))
    events: dict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    errors: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # first few "error" events
    banned: dict[int, str] = field(default_factory=dict)  # worker -> the coordinator's ban message
    first_commit_s: float | None = None

    def on_event(self, worker: int, worker_id: str, ev: dict[str, Any], t: float) -> str:
        """Record one worker event (`t` in run time); returns a line worth printing, or ""."""
        name = str(ev.get("event"))
        self.events[worker][name] += 1
        message = str(ev.get("message", ""))
        note = ""
        # a ban: refused with PERMISSION_DENIED, or ordered to leave with the ban's reason
        banned = "is banned" in message or message.startswith("ordered to leave: reputation")
        if banned and worker not in self.banned:
            self.banned[worker] = message
            note = f"banned by the coordinator: {message[:160]}"
        if name == "error" and len(self.errors[worker]) < 5:
            self.errors[worker].append(message[:300])
        if name == "ready":
            loss = ev.get("loss")
            if isinstance(loss, (int, float)):
                self.ready_loss.append((t, worker, str(ev.get("cell")), int(ev.get("round", 0)), float(loss)))
        elif name == "verdict":
            self.verdicts[worker][str(ev.get("verdict"))] += 1
            if ev.get("hash") and ev.get("verdict") in ("committed", "pending", "resync"):
                # the hash this worker computed and reported for the round
                self.hashes.append(
                    inv.HashObservation(t, worker_id, str(ev["cell"]), int(ev["round"]), str(ev["hash"]), "report")
                )
        elif name == "committed":
            cell, rnd, h = str(ev.get("cell")), int(ev.get("round", 0)), str(ev.get("hash", ""))
            self.acknowledged.append(inv.CommitEntry(cell, rnd, h, t))
            self.hashes.append(inv.HashObservation(t, worker_id, cell, rnd, h, "applied"))
            if self.first_commit_s is None:
                self.first_commit_s = t
        return note


def read_commit_log(coord_dir: Path, label: str, t: float, origin: float) -> tuple[inv.CommitLogRead, tuple[Any, ...]]:
    """The coordinator store's commit log at run time `t` (commit times in run time too):
    every cell's committed lineage with its epochs (`lineage`), and the full commit records
    of the current epochs (loss, contributors) for the report. Raises StoreError."""
    from bagel.coordinator.store import Store

    store = Store.open_readonly(coord_dir)
    try:
        snap = store.load(recent_commits=1 << 30)
        rows = store.commit_rows()
    finally:
        store.close()
    current = {c.cell_id: (c.rollbacks, c.committed_round) for c in snap.cells}
    entries = tuple(
        inv.CommitEntry(cell, rnd, hsh, ms / 1000.0 - origin, epoch)
        for cell, epoch, rnd, hsh, ms in lineage(rows, current)
    )
    return inv.CommitLogRead(t, label, entries), snap.commits


def lineage(
    rows: list[tuple[str, int, int, str, int]], current: dict[str, tuple[int, int]]
) -> list[tuple[str, int, int, str, int]]:
    """The commits that are still each cell's history, from every commit ever recorded
    (`rows`: cell, epoch, round, hash, ms) and each cell's current (epoch, committed round).

    An orphaned cell falls back to its checkpoint at round b and commits b + 1, ... again in
    the next epoch: the rows of an older epoch above the lowest rollback point of any later
    epoch were rolled back, and are left out, so the checker sees them lost (as they were);
    the rows at or below it stay, labelled with their epoch. A later epoch's rollback point
    is its first commit's round - 1, or, for the current epoch before it commits anything,
    the cell's committed round (the checkpoint it fell back to)."""
    by_cell: dict[str, dict[int, list[tuple[str, int, int, str, int]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_cell[row[0]][row[1]].append(row)
    out: list[tuple[str, int, int, str, int]] = []
    for cell in sorted(by_cell):
        epochs = by_cell[cell]
        cur_epoch, cur_round = current.get(cell, (max(epochs), 1 << 62))
        floor = cur_round if not epochs.get(cur_epoch) else 1 << 62
        for epoch in sorted(epochs, reverse=True):
            kept = epochs[epoch] if epoch >= cur_epoch else [r for r in epochs[epoch] if r[2] <= floor]
            out.extend(kept)
            if epochs[epoch]:
                floor = min(floor, min(r[2] for r in epochs[epoch]) - 1)
    out.sort(key=lambda r: (r[0], r[1], r[2]))
    return out


def local_hashes(workers: list[tuple[str, Path]], spec: RunSpec, t: float) -> list[inv.HashObservation]:
    """Every local checkpoint the workers kept, loaded and re-hashed by the worker's own
    loader; `workers` is (worker_id, data dir). A file that does not load is an observation
    of a hash that matches nothing (so the replicas invariant fails and says why)."""
    from bagel.worker.localstate import LocalStateError, LocalStore

    out: list[inv.HashObservation] = []
    # replicas of one round hold the same hashed tensors (only their error-feedback residuals
    # differ), so the canonical hash, the slow part, runs once per distinct content
    verified: dict[str, tuple[str, int, str]] = {}  # tensor digest -> (cell, round, state hash)
    for worker_id, data_dir in workers:
        base = data_dir / "runs" / spec.run.id
        files = sorted((base / "history").glob("*.safetensors")) + [base / "local.safetensors"]
        for path in files:
            if not path.exists():
                continue
            raw = path.read_bytes()
            digest = hashed_tensor_digest(raw)
            if digest is not None and digest in verified:
                cell, rnd, h = verified[digest]
                out.append(inv.HashObservation(t, worker_id, cell, rnd, h, "local"))
                continue
            store = LocalStore(data_dir, spec.run.id, spec.spec_hash)
            store.path = path  # the same loader and checks, on a kept per-round file
            try:
                cp = store.load()
            except LocalStateError as e:
                out.append(
                    inv.HashObservation(t, worker_id, _cell_of(path), _round_of(path), f"unreadable: {e}", "local")
                )
                continue
            if cp is None or cp.committed_round <= 0:
                continue
            if digest is not None:
                verified[digest] = (cp.cell_id, cp.committed_round, cp.state_hash)
            out.append(inv.HashObservation(t, worker_id, cp.cell_id, cp.committed_round, cp.state_hash, "local"))
    return out


def hashed_tensor_digest(raw: bytes) -> str | None:
    """sha256 over the name, dtype, shape and bytes of every hashed tensor (`w.*`, `m.*`) and
    the cell/round metadata of a safetensors file, or None if it does not parse. Equal
    digests mean equal inputs to the canonical state hash, so one verification serves both."""
    import hashlib

    try:
        n = int.from_bytes(raw[:8], "little")
        if len(raw) < 8 or n > len(raw) - 8:
            return None
        header = json.loads(raw[8 : 8 + n])
        data = memoryview(raw)[8 + n :]
        meta = header.get("__metadata__") or {}
        d = hashlib.sha256(json.dumps([meta.get("cell_id"), meta.get("committed_round")]).encode())
        for name in sorted(k for k in header if k.startswith(("w.", "m."))):
            info = header[name]
            lo, hi = info["data_offsets"]
            if not (0 <= lo <= hi <= len(data)):
                return None
            d.update(json.dumps([name, info["dtype"], info["shape"], hi - lo]).encode())
            d.update(data[lo:hi])
        return d.hexdigest()
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _cell_of(path: Path) -> str:
    return path.name.rsplit(".r", 1)[0] if ".r" in path.name else "?"


def _round_of(path: Path) -> int:
    try:
        return int(path.name.rsplit(".r", 1)[1].split(".")[0])
    except (IndexError, ValueError):
        return -1


def leaked_ports(sup: Supervisor) -> tuple[int, ...]:
    """Ports the run bound that are still listening and held by one of its processes, by
    this process, or by no process we can see. A port held by another program now is not
    ours: the OS may hand a freed port to anyone on a shared machine."""
    owners = port_owners(sup.bound_ports() & listening_ports(None))
    ours = {p.pgid for p in sup.procs}
    return tuple(
        sorted(
            port
            for port, pids in owners.items()
            if not pids or any(pid == os.getpid() or pid in sup.seen_pids or _pgid(pid) in ours for pid in pids)
        )
    )


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1


def runner_checks(fired: list[FiredFault], unexpected_exits: list[str], error: str) -> dict[str, inv.InvariantResult]:
    """Checks of the run itself, next to sim/invariants.py's checks of the system:

    - `all_faults_fired`: every scheduled fault was applied and the run was not cut short
      (a chaos run whose faults did not happen proves nothing);
    - `no_unexpected_exit`: no coordinator or worker process ended unless we ended it.
    """
    not_fired = [ff for ff in fired if ff.fired_s is None or ff.error]
    return {
        "all_faults_fired": inv.InvariantResult(
            "all_faults_fired",
            not not_fired and not error,
            tuple(
                f"fault {ff.index} ({ff.fault.kind.value} at {ff.fault.at_s:g}s): {ff.error or 'did not fire'}"
                for ff in not_fired
            )
            + ((f"run ended early: {error}",) if error else ()),
        ),
        "no_unexpected_exit": inv.InvariantResult("no_unexpected_exit", not unexpected_exits, tuple(unexpected_exits)),
    }


__all__ = [
    "FiredFault",
    "Observations",
    "hashed_tensor_digest",
    "leaked_ports",
    "local_hashes",
    "read_commit_log",
    "runner_checks",
]

"""The status document: one JSON schema for `bagel-coordinator status --json` from either
source, the store (`--data-dir`, read-only) or a live daemon (`--target`, GetStatus).

Both sources go through `document`, so the keys, the types (numbers as numbers, phases as
lowercase words, never protobuf enum names or int64-as-string) and the meaning of "not
known" (`null`) are the same. What a source cannot know is `null` there: the store holds
no volatile state (phases, leases, heartbeats, compute shares), GetStatus carries no round
history or checkpoint list. A cell that never committed has `null` loss, checkpoint, last
commit and ETA (the table shows "—"). README.md "Metrics and status" documents the keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from bagel.coordinator.metrics import commit_rate
from bagel.protocol import bagel_pb2 as pb

RECENT_COMMITS = 16  # commits of a cell the ETA's rate is measured over (the daemon keeps as many)

# keys only a live daemon knows: null in a document from the store
VOLATILE_WORKER_KEYS = ("phase", "lease_expires_unix_ms", "heartbeat_age_s")
VOLATILE_CELL_KEYS = ("target_share", "actual_share")
STORE_ONLY_KEYS = ("rounds", "checkpoints")


def eta_s(samples: int, target: int, rate: float) -> float | None:
    """Seconds until `samples` reaches `target` at `rate` samples/s; 0 once reached, None
    without a target or a rate."""
    if target <= 0:
        return None
    if samples >= target:
        return 0.0
    return (target - samples) / rate if rate > 0 else None


def phase_name(phase: int) -> str:
    return pb.Phase.Name(phase).removeprefix("PHASE_").lower()


def worker_doc(
    w: Any, *, now_ms: int, phase: str | None, lease_ms: int | None, heartbeat_ms: int | None
) -> dict[str, Any]:
    return {
        "worker_id": w.worker_id,
        "name": w.name,
        "state": w.state,
        "cell_id": w.cell_id,
        "phase": phase,
        "reputation": float(w.reputation),
        "samples_per_s": float(w.samples_per_s),
        "vram_bytes": int(w.vram_bytes),
        "host_memory_bytes": int(w.host_memory_bytes),
        "rounds_contributed": int(w.rounds_contributed),
        "lease_expires_unix_ms": lease_ms,
        "heartbeat_age_s": None if heartbeat_ms is None else max(0.0, (now_ms - heartbeat_ms) / 1000.0),
    }


def cell_doc(c: Any, *, members: Sequence[str], shares: tuple[float, float] | None) -> dict[str, Any]:
    """`c` has CellStatus's fields (a CellStatus, or the store's equivalent)."""
    trained = c.committed_round > 0
    rate = float(c.samples_per_s)
    target = int(c.sample_target)
    return {
        "cell_id": c.cell_id,
        "kind": c.kind,
        "round": int(c.round),
        "round_state": c.round_state,
        "committed_round": int(c.committed_round),
        "committed_hash": c.committed_hash,
        "trained": trained,
        "members": sorted(members),
        "target_share": None if shares is None else shares[0],
        "actual_share": None if shares is None else shares[1],
        "samples_committed": int(c.samples_committed),
        "last_loss": float(c.last_loss) if trained else None,
        "latest_checkpoint_round": int(c.latest_checkpoint_round) if c.latest_checkpoint_round >= 0 else None,
        "last_commit_unix_ms": int(c.last_commit_unix_ms) if c.last_commit_unix_ms > 0 else None,
        "sample_target": target or None,
        "samples_per_s": rate if rate > 0 else None,
        "eta_s": eta_s(int(c.samples_committed), target, rate),
        "rollbacks": int(c.rollbacks),
    }


def document(
    resp: pb.StatusResponse,
    *,
    source: str,
    live: bool,
    rounds: list[dict[str, Any]] | None = None,
    checkpoints: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The status document of a StatusResponse (`live`: from a daemon, with its volatile fields)."""
    now = int(resp.now_unix_ms)
    started = int(resp.started_unix_ms) or None
    workers = []
    for w in resp.workers:
        active = live and w.state == "active"
        workers.append(
            worker_doc(
                w,
                now_ms=now,
                phase=phase_name(w.phase) if active else None,
                lease_ms=int(w.lease_expires_unix_ms) if active else None,
                heartbeat_ms=int(w.last_heartbeat_unix_ms) if active and w.last_heartbeat_unix_ms else None,
            )
        )
    return {
        "source": source,
        "run_id": resp.run_id,
        "spec_hash": resp.spec_hash,
        "now_unix_ms": now,
        "started_unix_ms": started,
        "uptime_s": None if started is None else max(0.0, (now - started) / 1000.0),
        "detailed": bool(resp.detailed),
        "worker_counts": {k: int(v) for k, v in sorted(resp.worker_counts.items())},
        "workers": workers,
        "cells": [
            cell_doc(
                c, members=list(c.members), shares=(float(c.target_share), float(c.actual_share)) if live else None
            )
            for c in resp.cells
        ],
        "rounds": rounds,
        "checkpoints": checkpoints,
    }


def cell_commit_stats(commits: Iterable[Any]) -> dict[str, tuple[float, int]]:
    """cell -> (committed samples/s over its last RECENT_COMMITS commits, last commit ms),
    from CommitRecords oldest first."""
    per: dict[str, list[tuple[int, int]]] = {}
    for c in commits:
        per.setdefault(c.cell_id, []).append((c.committed_ms, c.samples))
    return {cell: (commit_rate(xs[-RECENT_COMMITS:]), xs[-1][0]) for cell, xs in per.items()}

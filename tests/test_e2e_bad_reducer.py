"""End to end: a member that returns a doctored averaged part is caught, not applied, and banned.

A real coordinator daemon and three real `bagel-worker` processes on loopback (hivemind
DHT and P2P, grpc.aio, SQLite), the harness of tests/test_e2e.py. One worker runs with
`--byzantine bad-reducer`: it trains and contributes honestly, but the part it reduces it
scales x1000 before encoding and signs a receipt for exactly those bytes, so its reply is
finite, the right size and consistent with its own receipt. The shadow reducer of that part
computes the honest digest, so

- no honest worker applies the round (each reports the exchange failed, naming the part
  and both reducers, and its state stays at the last committed hash);
- the shadow sends the signed inputs and the bad receipt to the coordinator (`Accuse`),
  which re-runs the reduction, bans the worker with a reason naming the verified
  evidence, and re-freezes the exchange without it;
- (the attacker may be a trained member or, having joined mid-round, a catch-up one: both
  reduce a part; tests/test_verified_reducers.py has the all-trained group over real peers)
- every round the cell commits afterwards is reduced over the honest workers only, and
  no commit in the log ever had the bad worker among its contributors.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bagel.coordinator.core.records import WorkerState
from bagel.coordinator.store import Store
from bagel.worker.swarm import Managed, cleanup

from test_e2e import CELL, Swarm

pytestmark = pytest.mark.slow


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    procs: list[Managed] = []
    with cleanup(procs):
        yield Swarm(tmp_path, procs)


def worker_id(s: Swarm, name: str) -> str:
    ids = [e["worker_id"] for e in s.events(name, "identity")]
    return ids[0] if ids else ""


@pytest.mark.timeout(420)
def test_a_doctored_averaged_part_is_not_applied_and_its_reducer_is_banned_on_verified_evidence(
    swarm: Swarm,
) -> None:
    s = swarm
    s.start_coordinator()
    honest = ["a", "b"]
    for n in honest:
        s.start_worker(n)
    # the attacker joins once the honest workers are in the cell: alone in a group there is
    # no second reducer to check it (a lone member owns its cell; that is the audits' job)
    for n in honest:
        s.wait(f"{n} registered", lambda n=n: s.events(n, "registered"), 120)
    s.start_worker("bad", "--byzantine", "bad-reducer")
    ids = {n: s.wait(f"{n}'s identity", lambda n=n: worker_id(s, n), 120) for n in (*honest, "bad")}
    bad = ids["bad"]

    def banned() -> bool:
        return any(w.worker_id == bad and w.state == "banned" for w in s.status().workers)

    s.wait("the bad reducer banned", banned, 240)
    # told so by the coordinator's refusal (no instruction of its own said LEAVE), it stops
    s.wait("the bad reducer stopped", lambda: not s.workers["bad"].alive(), 60)
    assert s.events("bad", "banned")
    # the honest workers go on and commit without it
    start = s.committed_round()
    s.wait("two more commits after the ban", lambda: s.committed_round() >= max(start, 0) + 2, 180)

    # the attacker joined the exchange like anyone (as a trained member, or a catch-up one when
    # it joined the cell mid-round: either way it reduces one part); its lie is only in what it returns
    assert s.events("bad", "ready") or s.events("bad", "catch-up")
    assert not s.events("bad", "train-failed")
    # every honest worker refused to apply the round whose part the bad worker reduced, or was
    # handed the exchange re-frozen without it before its own check of that part ended: the
    # first refusal convicts the reducer, and the coordinator re-freezes the others at once
    failures = {n: [e for e in s.events(n, "exchange-failed") if f"primary {bad}" in e["message"]] for n in honest}
    doctored = {(e["round"], e["reduce_attempt"]) for evs in failures.values() for e in evs}
    assert doctored, "no honest worker refused the doctored part"
    for n, evs in failures.items():
        assert all("the round is not applied" in e["message"] for e in evs)
        if not evs:
            moved_on = {(e["round"], e["reduce_attempt"] - 1) for e in s.events(n, "exchange")}
            assert doctored & moved_on, f"{n} neither refused the doctored part nor was re-frozen past it"
    accused = [e for n in honest for e in s.events(n, "accused")]
    assert any(e["convicted"] == bad and "verified evidence" in e["reason"] for e in accused), accused

    # nothing was adopted from a failed exchange: each honest worker's state after the failed
    # round is the next commit it agreed to, reached from the last committed hash
    for n in honest:
        failed_rounds = {r for r, _attempt in doctored}
        commits = s.commits(n)
        for r in failed_rounds:
            if r in commits:  # committed later, after the re-freeze without the bad worker
                assert commits[r]["contributors"] == len(honest), commits[r]

    assert s.coordinator is not None
    s.coordinator.stop()
    store = Store.open_readonly(s.root / "coord")
    try:
        snap = store.load(recent_commits=1000)
    finally:
        store.close()
    rec = next(w for w in snap.workers if w.worker_id == bad)
    assert rec.state is WorkerState.BANNED
    assert "verified evidence" in rec.reason and "primary reducer" in rec.reason, rec.reason
    assert all(w.state is not WorkerState.BANNED for w in snap.workers if w.worker_id != bad)
    commits = [c for c in snap.commits if c.cell_id == CELL]
    assert commits, "the cell never committed"
    for c in commits:
        assert bad not in c.contributors, f"round {c.round} committed with the bad reducer's exchange"
        assert set(c.agreeing) <= {ids[n] for n in honest}

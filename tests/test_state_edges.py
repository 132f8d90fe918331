"""Coordinator core: bad and late events, restore, and the cost of the hot paths.

- every error leaves the state exactly as it was (records, instructions, timers);
- the error -> gRPC status table;
- restore from the records the effects wrote rebuilds the same state, which then
  behaves exactly like the original;
- a heartbeat that changes nothing does no work and writes nothing; joining is bounded
  work whatever the number of workers (counted, never timed);
- a ban reaches every open round that still counts the worker, not only its cell's.
"""

from __future__ import annotations

import math
import random

import grpc
import pytest

from bagel.coordinator.core import errors as E
from bagel.coordinator.core.errors import GRPC_STATUS, grpc_status_name
from bagel.coordinator.core.events import (
    CheckpointStored,
    Heartbeat,
    LeaseExpired,
    Leave,
    Register,
    ReportRound,
    Tick,
)
from bagel.coordinator.core.policy import DILOCO_WAIT_ALL
from bagel.coordinator.core.records import RoundState, WorkerState
from bagel.protocol.grpc_options import RESTART_REATTACH_MS
from bagel.protocol.messages import LocalState, Order, PeerAddress, Phase, Profile, Verdict

from test_state_harness import GB, Harness, h, make_spec, profile, restored

CELL = "k0.r0"


def rich_state() -> Harness:
    """Two commits in k0.r0, a third round REDUCING with one report, a checkpoint, a
    router-only worker, a lost worker and a banned one."""
    hz = Harness(spec=make_spec(router=True, ban_reputation=-1.5), max_workers=8)
    for w in ("a", "b", "c"):
        hz.reg(w, vram_gb=24)
    hz.reg("r", vram_gb=4)  # fits only the router (2 GB of 4 x 0.8)
    assert hz.store.workers["r"].cell_id == "router"
    assert {hz.store.workers[w].cell_id for w in "abc"} == {CELL}
    hz.hb("a")
    hz.hb("r")
    for n in (1, 2):
        for m in hz.round(CELL).members:
            hz.ready(m.worker_id)
        contributors = hz.round(CELL).contributors
        assert contributors == ("a", "b", "c")  # members, or catch-up after a late report
        ra = hz.st.instruction_for("a").reduce_attempt
        for w in "cab" if n == 2 else "abc":  # c (catch-up in round 2) disagrees: banned (-2 < -1.5)
            hz.report(w, h(66) if (w, n) == ("c", 2) else h(n), round=n, reduce_attempt=ra)
    hz.apply(CheckpointStored(CELL, 2, h(2)))
    assert hz.store.workers["c"].state is WorkerState.BANNED
    hz.reg("d")
    hz.reg("lost")
    hz.advance(11_000)
    for w in ("a", "b", "d", "r"):
        hz.hb(w)
    hz.tick()
    assert hz.store.workers["lost"].state is WorkerState.LOST
    hz.ready("a")
    hz.ready("b")
    r = hz.round(CELL)
    assert r is not None and r.state is RoundState.REDUCING and r.round == 3
    hz.report("a", h(3))
    return hz


def frozen_view(hz: Harness) -> tuple[object, ...]:
    st = hz.st
    ins = {}
    for w in hz.store.workers.values():
        if w.state in (WorkerState.ACTIVE, WorkerState.BANNED):
            ins[w.worker_id] = st.instruction_for(w.worker_id)
    return (
        st.snapshot(),
        ins,
        st.next_wakeup_ms(),
        st.shares(),
        st.counts(),
        sorted(st.roster.leases),
        sorted(st.rounds.deadlines),
    )


def bad_events(hz: Harness) -> list[tuple[object, type[E.CoordinatorError]]]:
    local = hz.store.workers["a"].local
    prof = Profile(vram_bytes=24 * GB, samples_per_s={CELL: 10.0})
    return [
        (Heartbeat("nobody", Phase.IDLE), E.UnknownWorker),
        (Heartbeat("lost", Phase.IDLE), E.UnknownWorker),
        (Heartbeat("c", Phase.IDLE), E.Banned),
        (Heartbeat("a", Phase.UNSPECIFIED), E.InvalidEvent),
        (Heartbeat("a", 99), E.InvalidEvent),  # type: ignore[arg-type]
        (Heartbeat("a", Phase.READY, CELL, 3, samples=-1), E.InvalidEvent),
        (Heartbeat("a", Phase.IDLE, local=LocalState(CELL, -1, "")), E.InvalidEvent),
        (Register("", prof), E.InvalidEvent),
        (Register("n", Profile(vram_bytes=-1)), E.InvalidEvent),
        (Register("n", Profile(vram_bytes=GB, samples_per_s={CELL: math.nan})), E.InvalidEvent),
        (Register("n", prof, local=LocalState(CELL, -2, "")), E.InvalidEvent),
        (Register("c", prof), E.Banned),
        (ReportRound("a", "k9.r9", 3, h(3)), E.InvalidEvent),
        (ReportRound("a", "router", 1, h(1)), E.WrongCell),
        (ReportRound("a", CELL, 0, h(1)), E.InvalidEvent),
        (ReportRound("a", CELL, 1, h(1)), E.StaleRound),
        (ReportRound("a", CELL, 9, h(1)), E.InvalidEvent),
        (ReportRound("b", CELL, 3, ""), E.InvalidEvent),
        (ReportRound("b", CELL, 3, h(3), samples=-5), E.InvalidEvent),
        (ReportRound("a", CELL, 3, h(4), reduce_attempt=0), E.DuplicateSubmission),
        (ReportRound("b", CELL, 3, h(3), reduce_attempt=7), E.InvalidEvent),
        (ReportRound("nobody", CELL, 3, h(3)), E.UnknownWorker),
        (Leave("nobody"), E.UnknownWorker),
        (LeaseExpired("nobody"), E.UnknownWorker),
        (CheckpointStored("k9.r9", 1, h(1)), E.InvalidEvent),
        (CheckpointStored(CELL, 3, h(3)), E.InvalidRunState),
        (CheckpointStored(CELL, 2, h(5)), E.InvalidRunState),
        ("not an event", E.InvalidEvent),
        (local, E.InvalidEvent),
    ]


def test_errors_leave_state_unchanged() -> None:
    hz = rich_state()
    events = bad_events(hz)
    before = frozen_view(hz)
    for ev, err in events:
        with pytest.raises(err):
            hz.st.apply(hz.now, ev)  # type: ignore[arg-type]
        assert frozen_view(hz) == before, f"{ev!r} changed the state"
    with pytest.raises(E.InvalidEvent):
        hz.st.apply(1.5, Tick())  # type: ignore[arg-type]
    # the run is full (max_workers=8 counts active workers: a b d r)
    for i in range(4):
        hz.reg(f"x{i}", vram_gb=24)
    full = frozen_view(hz)
    with pytest.raises(E.CapacityExceeded):
        hz.st.apply(hz.now, Register("x9", Profile(vram_bytes=GB)))
    assert frozen_view(hz) == full
    # ... but a registered worker may re-register
    hz.reg("x0", vram_gb=24)


def test_report_before_freeze_and_from_a_non_contributor() -> None:
    hz = Harness()
    for w in "ab":
        hz.reg(w)
    hz.hb("a")
    with pytest.raises(E.WrongPhase):
        hz.report("a", h(1))
    hz.ready("a")
    hz.ready("b")
    hz.report("a", h(1))
    hz.report("b", h(1))
    hz.reg("late")  # round 2 is open; late needs round 1's state
    with pytest.raises(E.WrongPhase):
        hz.apply(ReportRound("late", CELL, 2, h(2)))


def test_duplicate_report_is_a_noop() -> None:
    hz = Harness()
    for w in "abc":
        hz.reg(w)
    hz.hb("a")
    for w in "abc":
        hz.ready(w)
    hz.report("a", h(1))
    before = hz.st.snapshot()
    out = hz.report("a", h(1))  # a retry after a lost answer
    assert out.verdict is Verdict.PENDING and out.effects == ()
    assert hz.st.snapshot() == before


def test_grpc_status_table() -> None:
    expected = {
        E.InvalidEvent: "INVALID_ARGUMENT",
        E.UnknownWorker: "NOT_FOUND",
        E.InvalidRunState: "FAILED_PRECONDITION",
        E.WrongCell: "FAILED_PRECONDITION",
        E.WrongPhase: "FAILED_PRECONDITION",
        E.StaleRound: "FAILED_PRECONDITION",
        E.DuplicateSubmission: "ALREADY_EXISTS",
        E.Banned: "PERMISSION_DENIED",
        E.CapacityExceeded: "RESOURCE_EXHAUSTED",
    }
    for cls, name in expected.items():
        assert grpc_status_name(cls("x")) == name
        assert issubclass(cls, E.CoordinatorError)
    # every core error class has an entry, and every entry is a real gRPC code
    subclasses = {c for c in vars(E).values() if isinstance(c, type) and issubclass(c, E.CoordinatorError)}
    assert subclasses == set(GRPC_STATUS)
    for name in GRPC_STATUS.values():
        assert grpc.StatusCode[name]

    class Custom(E.WrongPhase):
        pass

    assert grpc_status_name(Custom()) == "FAILED_PRECONDITION"  # inherited along the MRO
    assert grpc_status_name(ValueError()) == "INTERNAL"


def test_restore_round_trip_and_continue() -> None:
    hz = rich_state()
    snap = hz.st.snapshot()
    st2 = restored(hz, rng=random.Random(7), max_workers=8)
    assert st2.snapshot() == snap
    for w in snap.workers:
        if w.state is WorkerState.ACTIVE:
            assert st2.instruction_for(w.worker_id) == hz.st.instruction_for(w.worker_id)
            # lease renewed: a lease, plus the time a backed-off channel needs to reconnect
            assert st2.worker_phase(w.worker_id)[4] == hz.now + RESTART_REATTACH_MS + 10_000
    assert st2.shares() == pytest.approx(hz.st.shares())
    # both continue identically: b's report commits round 3 on either
    outs = [s.apply(hz.now, ReportRound("b", CELL, 3, h(3), samples=100, compute_ms=1000)) for s in (hz.st, st2)]
    assert outs[0].verdict is outs[1].verdict is Verdict.COMMITTED
    assert hz.st.snapshot() == st2.snapshot()
    assert st2.instruction_for("a").order is Order.TRAIN and st2.instruction_for("a").round == 4


def test_restore_reattaches_then_expires_silent_workers() -> None:
    hz = rich_state()
    st2 = restored(hz)
    attempt = hz.round(CELL).attempt
    # a lease (10 s) after the restart nobody is lost yet: channels may still be backing off
    st2.apply(hz.now + 10_500, Tick())
    assert all(w.state is WorkerState.ACTIVE for w in st2.snapshot().workers if w.worker_id in ("a", "b", "d"))
    now = hz.now + RESTART_REATTACH_MS + 5_000
    st2.apply(now, Heartbeat("a", Phase.REDUCING, CELL, 3, reduce_attempt=1, local=LocalState(CELL, 2, h(2))))
    st2.apply(now + 6_000, Tick())  # b, d and r said nothing since the restart
    snap = {w.worker_id: w.state for w in st2.snapshot().workers}
    assert snap["a"] is WorkerState.ACTIVE
    assert snap["b"] is WorkerState.LOST and snap["d"] is WorkerState.LOST
    # b, a contributor, is lost before reporting; a's report alone is no quorum: re-run
    rec = st2.cell_view(CELL)[1]
    assert rec is not None and (rec.round, rec.state, rec.attempt) == (3, RoundState.OPEN, attempt + 1)


def test_restore_rejects_inconsistent_records() -> None:
    hz = rich_state()
    snap = hz.st.snapshot()
    with pytest.raises(ValueError):
        type(hz.st).restore(
            hz.spec,
            hz.cells,
            workers=snap.workers,
            cell_records=snap.cells,
            rounds=snap.rounds + snap.rounds,
            now_ms=hz.now,
        )


# ---------------------------------------------------------------- cost of the hot paths


def big(n: int) -> Harness:
    hz = Harness(spec=make_spec(clusters=2, ranges=2, router=True, max_replicas=100_000, min_replicas=2))
    for i in range(n):
        hz.st.apply(
            hz.now,
            Register(
                f"w{i:05d}",
                Profile(
                    vram_bytes=(8 + i % 5 * 8) * GB, samples_per_s={c: 50.0 + i % 7 * 20 for c in hz.spec.cell_ids}
                ),
            ),
        )
    return hz


def test_noop_heartbeat_does_no_work_and_writes_nothing() -> None:
    for n in (50, 1000):
        hz = big(n)
        st = hz.st
        wid = "w00003"
        ins = st.instruction_for(wid)
        st.apply(hz.now, Heartbeat(wid, Phase.IDLE, ins.cell_id, local=LocalState()))  # may open a round
        ins = st.instruction_for(wid)
        assert ins.order is Order.TRAIN
        st.apply(hz.now, Heartbeat(wid, Phase.TRAINING, ins.cell_id, ins.round, local=LocalState()))  # -> TRAINING
        ops = st.ops
        for k in range(100):
            ins = st.instruction_for(wid)
            out = st.apply(
                hz.now + k,
                Heartbeat(
                    wid,
                    Phase.TRAINING,
                    ins.cell_id,
                    ins.round,
                    inner_step=k,
                    local=LocalState(),
                    round_attempt=ins.round_attempt,
                ),
            )
            assert out.effects == ()
        assert st.ops == ops, f"{n} workers: a no-op heartbeat looped over something"
        assert len(st.roster.leases) <= n  # lease renewals do not grow the heap


def test_join_and_tick_work_is_bounded() -> None:
    costs = {}
    for n in (100, 1000):
        hz = big(n)
        st = hz.st
        ops = st.ops
        st.apply(
            hz.now, Register("new", Profile(vram_bytes=24 * GB, samples_per_s={c: 90.0 for c in hz.spec.cell_ids}))
        )
        costs[n] = st.ops - ops
        ops = st.ops
        st.apply(hz.now + 1, Tick())  # nothing expired, no deadline
        assert st.ops == ops
    bound = 32 * 4 + 32  # candidates x moves + standby scan
    assert costs[1000] <= bound and costs[100] <= bound, costs


def test_ready_is_volatile_and_relearned_after_restore() -> None:
    hz = Harness()
    for w in "abc":
        hz.reg(w)
    hz.hb("a")
    hz.hb("a", Phase.TRAINING)
    for w in "ab":
        out = hz.ready(w)
        assert out.effects == ()  # no write per READY: O(members) writes per round
    st2 = restored(hz)
    rec = st2.cell_view(CELL)[1]
    assert rec is not None and rec.state is RoundState.TRAINING and rec.ready == {}
    # the deadline waits at least a lease after the restart, so workers can re-attach
    assert st2.next_wakeup_ms() is not None and st2.next_wakeup_ms() >= hz.now + 10_000  # type: ignore[operator]
    ins = st2.instruction_for("a")
    for w in "abc":  # ready workers keep saying so; c finishes now
        out = st2.apply(
            hz.now + 1,
            Heartbeat(w, Phase.READY, CELL, 1, samples=100, local=LocalState(), round_attempt=ins.round_attempt),
        )
    rec = st2.cell_view(CELL)[1]
    assert rec is not None and rec.state is RoundState.REDUCING and rec.contributors == ("a", "b", "c")
    assert rec.ready == {"a": 100, "b": 100, "c": 100}
    assert any(getattr(e, "state", None) is RoundState.REDUCING for e in out.effects)


def test_ban_in_a_new_cell_refreezes_the_round_a_lost_lease_left_it_in() -> None:
    """Without fail_fast_leases a lost contributor stays counted in its round until the
    deadline; re-registered into another cell and banned there, it must leave that old
    round too: no REDUCE names it and no commit is made of its bytes."""
    hz = Harness(spec=make_spec(clusters=2, ban_reputation=-1.5), policy=DILOCO_WAIT_ALL)
    for w in ("x", "b", "a"):
        hz.reg(w)
    old = hz.store.workers["x"].cell_id
    assert old == hz.store.workers["a"].cell_id != hz.store.workers["b"].cell_id
    hz.hb("x")
    hz.ready("x")
    hz.ready("a")
    assert hz.round(old).contributors == ("a", "x")
    hz.apply(LeaseExpired("x"))
    assert hz.store.workers["x"].state is WorkerState.LOST
    assert hz.round(old).contributors == ("a", "x") and hz.round(old).dropped == ()  # kept counted
    hz.reg("d")  # fills the old cell's hole, so x comes back in the other one
    hz.reg("x")
    new = hz.store.workers["x"].cell_id
    assert new != old and hz.round(old).state is RoundState.REDUCING
    hz.hb("b")
    for m in hz.round(new).members:
        hz.ready(m.worker_id)
    assert "x" in hz.round(new).contributors
    out = hz.report("x", h(1), samples=10**6)  # more than its budget: a lie, -3, banned
    assert out.verdict is Verdict.ABORTED and hz.store.workers["x"].state is WorkerState.BANNED
    r = hz.round(old)
    assert r is not None and r.state is RoundState.REDUCING and "x" not in r.contributors and "x" in r.dropped
    ins = hz.st.instruction_for("a")
    assert ins.order is Order.REDUCE and ins.reduce_attempt == r.reduce_attempt
    assert "x" not in {m.worker_id for m in ins.contributors}
    assert "x" not in {m.worker_id for m in restored(hz).instruction_for("a").contributors}  # as stored
    assert hz.report("a", h(9)).verdict is Verdict.COMMITTED
    (m,) = [m for m in hz.store.commits if m.cell_id == old]
    assert m.contributors == ("a", "d") and m.agreeing == ("a",)


def test_a_newcomer_after_a_restart_does_not_roll_back_rounds_its_holders_still_hold() -> None:
    # a and b commit round 3; the checkpoint holds round 2 (every 2 rounds)
    hz = Harness(spec=make_spec())
    hz.reg("a")
    hz.reg("b")
    hz.hb("a")
    for n in (1, 2, 3):
        for m in hz.round(CELL).members:
            hz.ready(m.worker_id)
        ra = hz.st.instruction_for("a").reduce_attempt
        for w in "ab":
            hz.report(w, h(n), round=n, reduce_attempt=ra)
    hz.apply(CheckpointStored(CELL, 2, h(2)))
    assert (hz.cell().committed_round, hz.cell().checkpoint_round) == (3, 2)
    lease_ms = 10_000
    # the coordinator restarts; a and b's channels back off, and come back after more than a
    # lease: a newcomer registers first, and needs the cell's state
    st2 = restored(hz)
    late = hz.now + lease_ms + RESTART_REATTACH_MS // 2
    st2.apply(late, Tick())
    st2.apply(late, Register("n", profile(hz.spec), PeerAddress("peer-n", ("/ip4/127.0.0.1/tcp/1",))))
    cell = st2.cell_view(CELL)[0]
    assert (cell.committed_round, cell.committed_hash) == (3, h(3))  # not rolled back to round 2
    ins = st2.instruction_for("n")
    assert ins.order is Order.SYNC and ins.committed_round == 3 and {d.worker_id for d in ins.donors} <= {"a", "b"}
    st2.apply(late, Heartbeat("a", Phase.IDLE, CELL, local=LocalState(CELL, 3, h(3))))
    assert st2.cell_view(CELL)[0].committed_round == 3

    # the bound is still there: holders silent past the grace are lost, the newcomer waits
    # `schedule.orphan_grace_s` (20 s) for one of them, and then its need rolls the cell back
    # to its checkpoint (what a lost round costs)
    st3 = restored(hz)
    gone = hz.now + lease_ms + RESTART_REATTACH_MS + 1
    st3.apply(gone, Tick())
    st3.apply(gone, Register("n", profile(hz.spec), PeerAddress("peer-n", ("/ip4/127.0.0.1/tcp/1",))))
    assert st3.cell_view(CELL)[0].committed_round == 3
    assert st3.instruction_for("n").order is Order.WAIT
    for t in (gone + 8_000, gone + 16_000):  # the newcomer keeps its lease meanwhile
        st3.apply(t, Heartbeat("n", Phase.IDLE, CELL))
    st3.apply(gone + 19_999, Tick())
    assert st3.cell_view(CELL)[0].committed_round == 3
    st3.apply(gone + 20_000, Tick())
    assert st3.cell_view(CELL)[0].committed_round == 2

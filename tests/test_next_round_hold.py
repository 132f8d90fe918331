"""No stranded contributors: after a commit the next round waits for the committed round's
late reporters (`Rounds.hold_next_round`), at most `schedule.next_round_grace_s`.

Core unit tests under fake time (tests/test_state_harness.py checks every transition's
effects against a fake store); the in-process gRPC cluster test is in tests/test_cluster.py.
"""

from __future__ import annotations

from bagel.coordinator.core.events import Leave
from bagel.coordinator.core.records import RoundState
from bagel.protocol.messages import Instruction, LocalState, Order, Phase, Verdict
from bagel.worker.reconciler import DropWork, Work, WorkerView, decide

from test_state_harness import Harness, h, make_spec, restored

CELL = "k0.r0"


def _round_one(hz: Harness, ids: str = "abc") -> None:
    """Round 1 with members `ids`, all ready and frozen; nobody has reported yet."""
    for w in ids:
        hz.reg(w)
    hz.hb(ids[0])
    for w in ids:
        hz.ready(w)
    r = hz.round()
    assert r is not None and r.state is RoundState.REDUCING and r.contributors == tuple(ids)


def test_a_member_that_reports_after_the_quorum_trains_the_next_round() -> None:
    hz = Harness()
    _round_one(hz, "abcd")
    hz.report("a", h(1))
    hz.report("b", h(1))
    assert hz.report("c", h(1)).verdict is Verdict.COMMITTED  # 3 of 4 > 0.5 x 4
    assert hz.round() is None  # d has not reported: round 2 waits for it
    assert hz.st.next_round_hold_ms(CELL) == hz.now + 30_000  # the default grace
    hz.advance(2_000)
    late = hz.report("d", h(1), round=1, reduce_attempt=1)
    assert late.verdict is Verdict.COMMITTED and hz.local("d") == LocalState(CELL, 1, h(1))
    r2 = hz.round()
    assert r2 is not None and r2.round == 2 and [m.worker_id for m in r2.members] == ["a", "b", "c", "d"]
    assert late.instruction is not None and late.instruction.order is Order.TRAIN
    assert late.instruction.plan is not None and "d" in [m.worker_id for m in late.instruction.plan.members]
    assert hz.st.next_round_hold_ms(CELL) is None


def test_the_grace_bounds_the_wait_for_a_silent_contributor() -> None:
    hz = Harness(make_spec(next_round_grace_s=4.0))
    _round_one(hz)
    hz.report("a", h(1))
    hz.report("b", h(1))
    assert hz.round() is None
    hz.advance(3_999)
    hz.tick()
    assert hz.round() is None
    hz.advance(1)
    hz.tick()  # the grace is over: round 2 opens with the holders there are
    r2 = hz.round()
    assert r2 is not None and r2.round == 2 and [m.worker_id for m in r2.members] == ["a", "b"]
    # c reports after all: it holds the state, and waits for the round after
    assert hz.report("c", h(1), round=1, reduce_attempt=1).verdict is Verdict.COMMITTED
    assert hz.st.instruction_for("c").order is Order.WAIT


def test_a_late_report_with_another_hash_or_a_lost_contributor_ends_the_wait() -> None:
    hz = Harness()
    _round_one(hz, "abcde")
    for w in "abc":
        hz.report(w, h(1))
    assert hz.round() is None  # waiting for d and e
    # d reports another hash: it must resync, so nobody waits for it
    ins = hz.st.instruction_for("d")  # still exchanging: finish it and report
    assert ins.order is Order.WAIT and ins.committed_round == 1 and "finish its exchange" in ins.reason
    assert hz.report("d", h(9), round=1, reduce_attempt=1).verdict is Verdict.RESYNC
    assert hz.round() is None
    hz.apply(Leave("e", "session over"))  # e leaves: it was the last one awaited
    r2 = hz.round()
    assert r2 is not None and [m.worker_id for m in r2.members] == ["a", "b", "c"]
    assert hz.st.instruction_for("d").order is Order.SYNC


def test_a_lost_lease_ends_the_wait() -> None:
    hz = Harness()
    _round_one(hz)
    hz.report("a", h(1))
    hz.report("b", h(1))
    assert hz.round() is None
    hz.keepalive(hz.now + 10_000, "a", "b")  # c stops heartbeating: its lease (10 s) runs out
    assert hz.store.workers["c"].state.value == "lost"
    r2 = hz.round()
    assert r2 is not None and [m.worker_id for m in r2.members] == ["a", "b"]


def test_zero_grace_opens_the_next_round_at_once() -> None:
    hz = Harness(make_spec(next_round_grace_s=0.0))
    _round_one(hz)
    hz.report("a", h(1))
    hz.report("b", h(1))
    r2 = hz.round()
    assert r2 is not None and [m.worker_id for m in r2.members] == ["a", "b"]
    assert hz.st.next_round_hold_ms(CELL) is None


def test_a_restarted_core_does_not_wait() -> None:
    hz = Harness()
    _round_one(hz)
    hz.report("a", h(1))
    hz.report("b", h(1))
    assert hz.round() is None
    hz.st = restored(hz)  # the wait is volatile: the first holder's heartbeat opens round 2
    assert hz.st.next_round_hold_ms(CELL) is None
    assert hz.hb("a").instruction.order is Order.TRAIN
    r2 = hz.round()
    assert r2 is not None and [m.worker_id for m in r2.members] == ["a", "b"]


def test_an_awaited_contributor_that_adopted_without_reporting_ends_the_wait() -> None:
    """A worker may learn of the commit from a heartbeat answer before its own report goes
    out, adopt its outcome and never report: its heartbeat holding the new state ends the wait."""
    hz = Harness()
    _round_one(hz)
    hz.report("a", h(1))
    hz.report("b", h(1))
    assert hz.round() is None
    hz.hb("c", Phase.IDLE, local=LocalState(CELL, 1, h(1)))
    r2 = hz.round()
    assert r2 is not None and [m.worker_id for m in r2.members] == ["a", "b", "c"]


def test_the_worker_finishes_the_exchange_of_the_round_just_committed() -> None:
    """reconciler.decide: a WAIT that shows the round of the exchange in flight committed keeps
    the exchange (it reports, and adopts on the verdict); any other WAIT drops it."""
    held = LocalState(CELL, 0, "")
    exchanging = Work(CELL, 1, 1, ready=True, reduce_attempt=1, exchanging=True)
    view = WorkerView("c", held, exchanging)
    assert decide(Instruction(Order.WAIT, CELL, 2, 1, h(1), reason="finish"), view) == ()
    # the round before: not the one it exchanges
    assert decide(Instruction(Order.WAIT, CELL, 1, 0, ""), view) == (DropWork("ordered to wait"),)
    # another cell
    assert decide(Instruction(Order.WAIT, "k1.r0", 2, 1, h(1)), view) == (DropWork("ordered to wait"),)
    # an exchange no longer running (it failed, or its report was answered)
    done = WorkerView("c", held, Work(CELL, 1, 1, ready=True, reduce_attempt=1))
    assert decide(Instruction(Order.WAIT, CELL, 2, 1, h(1)), done) == (DropWork("ordered to wait"),)

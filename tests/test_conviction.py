"""The core's side of a verified accusation: `Convicted` bans, and the exchange never commits.

The shell applies `Convicted` only after `bagel.robust.evidence.adjudicate` re-ran the
disputed reduction; here the core is driven directly (fake time, the effects checked
against the harness's fake store), including a contributor that reported a hash of the
doctored result before the evidence arrived.
"""

from __future__ import annotations

import pytest

from bagel.coordinator.core.errors import Banned, InvalidEvent, UnknownWorker
from bagel.coordinator.core.events import Convicted
from bagel.coordinator.core.records import CommitRecord, RoundState, WorkerState
from bagel.protocol.messages import Order, Verdict

from test_state import freeze_all, reported_left_and_came_back, start
from test_state_harness import Harness, h, make_spec

CELL = "k0.r0"


def convicted(wid: str, *, reduce_attempt: int = 1, accuser: str = "b") -> Convicted:
    return Convicted(wid, accuser, CELL, 1, 1, reduce_attempt, "verified evidence: test")


def test_conviction_bans_refreezes_without_the_liar_and_its_hash_never_commits() -> None:
    hz = Harness(spec=make_spec(quorum=0.5))
    start(hz, "a", "b", "c", "d")
    freeze_all(hz, "a", "b", "c", "d")
    assert hz.st.frozen_set(CELL, 1, 1, 1) is not None
    assert [m[0] for m in hz.st.frozen_set(CELL, 1, 1, 1) or ()] == ["a", "b", "c", "d"]
    # the liar claims success with the doctored state; an honest member reports the failure
    assert hz.report("d", h(666)).verdict is Verdict.PENDING
    rep_c = hz.store.workers["c"].reputation
    assert hz.report("c", "", failed=True, reason="part 3 disagrees").verdict is Verdict.PENDING
    assert hz.store.workers["c"].reputation < rep_c  # a failed report costs reputation...
    hz.apply(convicted("d"))
    assert hz.store.workers["c"].reputation == rep_c  # ...refunded: the liar caused it
    w = hz.store.workers["d"]
    assert w.state is WorkerState.BANNED and "verified evidence: test" in w.reason and "accused by b" in w.reason
    r = hz.round()
    assert r is not None and r.state is RoundState.REDUCING
    assert r.reduce_attempt == 2 and r.contributors == ("a", "b", "c")  # re-frozen without the liar
    assert hz.st.instruction_for("a").order is Order.REDUCE
    with pytest.raises(Banned):
        hz.hb("d")
    hz.report("a", h(1))
    assert hz.report("b", h(1)).verdict is Verdict.COMMITTED  # 2 > 0.5 x 3 weighted
    commits = [c for c in hz.store.commits if c.cell_id == CELL]
    assert [c.state_hash for c in commits] == [h(1)] and "d" not in commits[0].contributors
    # the frozen set of the discarded exchange is still known (evidence may come late)
    assert [m[0] for m in hz.st.frozen_set(CELL, 1, 1, 1) or ()] == ["a", "b", "c", "d"]
    # a second accusation of the same worker changes nothing
    before = hz.st.snapshot()
    out = hz.apply(convicted("d", accuser="c"))
    assert out.effects == () and hz.st.snapshot() == before


def test_conviction_with_too_few_survivors_aborts_the_attempt() -> None:
    hz = Harness(spec=make_spec(quorum=0.75))
    start(hz, "a", "b", "c")
    freeze_all(hz, "a", "b", "c")
    hz.report("c", h(666))
    hz.apply(convicted("c"))  # 2 survivors of 3 are under ceil(0.75 x 3): the attempt aborts
    assert hz.store.workers["c"].state is WorkerState.BANNED
    assert not [c for c in hz.store.commits if c.cell_id == CELL]
    r = hz.round()
    assert r is not None and r.attempt == 2 and r.state is RoundState.OPEN  # re-run by a and b
    assert [m.worker_id for m in r.members] == ["a", "b"]


def test_conviction_of_a_stale_exchange_bans_without_touching_the_open_round() -> None:
    hz = Harness(spec=make_spec(quorum=0.5))
    start(hz, "a", "b", "c", "d")
    freeze_all(hz, "a", "b", "c", "d")
    for x in "abc":
        hz.report(x, h(1))  # 3 > 0.5 x 4: committed
    assert any(isinstance(c, CommitRecord) for c in hz.store.commits)
    hz.apply(convicted("d"))  # about round 1 attempt 1, committed without its bytes mattering
    assert hz.store.workers["d"].state is WorkerState.BANNED
    assert hz.cell().committed_round == 1


def test_bad_convictions_are_refused_and_change_nothing() -> None:
    hz = Harness()
    start(hz)
    freeze_all(hz)
    before = hz.st.snapshot()
    with pytest.raises(UnknownWorker):
        hz.apply(convicted("nobody"))
    with pytest.raises(InvalidEvent):
        hz.apply(Convicted("c", "b", CELL, 1, 1, 1, ""))
    with pytest.raises(InvalidEvent):
        hz.apply(Convicted("c", "b", "k9.r9", 1, 1, 1, "x"))
    assert hz.st.snapshot() == before


def test_a_conviction_refreezes_another_exchange_its_worker_reported_in_and_then_left() -> None:
    """A contributor that reported and left stays in its exchange's frozen set (its part was
    delivered). Convicted later for a lie in another exchange, it must leave that one too, as
    any ban does: the REDUCE names it no more and the round cannot commit with its bytes."""
    hz = Harness()
    first = reported_left_and_came_back(hz)
    # proven to have lied in an exchange that is no longer open (round 1, reduce attempt 9)
    hz.apply(Convicted("a", "c", CELL, 1, 1, first + 8, "verified evidence: an older exchange"))
    assert hz.store.workers["a"].state is WorkerState.BANNED
    ins = hz.st.instruction_for("b")
    assert ins.order is Order.REDUCE and ins.reduce_attempt > first
    assert {m.worker_id for m in ins.contributors} == {"b", "c"}

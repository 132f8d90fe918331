"""Round lifecycle of the coordinator core under fake time (one cell, a few workers).

Every transition is checked against a fake store fed only by `Outcome.effects`
(tests/test_state_harness.py), so these tests also prove the effects are complete.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bagel.coordinator.core.policy import BAGEL, DILOCO_WAIT_ALL, SYNC_DP
from bagel.coordinator.core.records import CommitRecord, RoundRecord, RoundState, WorkerRecord, WorkerState
from bagel.protocol.messages import LocalState, Order, Phase, Verdict
from bagel.protocol.runspec import SyncSection

from test_state_harness import Harness, h, make_spec, restored

CELL = "k0.r0"


def three(hz: Harness, *ids: str, speed: float = 100.0) -> None:
    for w in ids or ("a", "b", "c"):
        out = hz.reg(w, speed=speed)
        assert out.instruction is not None and out.instruction.order is Order.WAIT  # round 0: nothing to fetch
        assert out.instruction.cell_id == CELL


def start(hz: Harness, *ids: str) -> RoundRecord:
    ids = ids or ("a", "b", "c")
    three(hz, *ids)
    out = hz.hb(ids[0])
    r = hz.round()
    assert r is not None and r.state is RoundState.OPEN
    assert any(isinstance(e, RoundRecord) for e in out.effects)
    return r


def freeze_all(hz: Harness, *ids: str) -> RoundRecord:
    ids = ids or ("a", "b", "c")
    for w in ids:
        hz.ready(w)
    r = hz.round()
    assert r is not None and r.state is RoundState.REDUCING
    return r


def commit(hz: Harness, n: int, *ids: str) -> None:
    """Round n of the open round's members `ids` (default a, b): all ready, all report h(n)."""
    ids = ids or ("a", "b")
    freeze_all(hz, *ids)
    for w in ids:
        hz.report(w, h(n))


def test_full_round_lifecycle() -> None:
    hz = Harness()
    r = start(hz)
    assert r.round == 1 and r.attempt == 1
    assert [m.worker_id for m in r.members] == ["a", "b", "c"]
    ins = hz.st.instruction_for("b")
    assert ins.order is Order.TRAIN and ins.round == 1 and ins.committed_round == 0 and ins.round_attempt == 1
    assert ins.plan is not None and [m.worker_id for m in ins.plan.members] == ["a", "b", "c"]
    assert ins.plan.deadline_unix_ms == r.deadline_ms > hz.now

    hz.hb("b", Phase.TRAINING, inner_step=3)
    assert hz.round().state is RoundState.TRAINING
    hz.ready("a")
    hz.ready("b")
    assert hz.round().state is RoundState.TRAINING  # c still training
    r = freeze_all(hz, "c")
    assert r.contributors == ("a", "b", "c") and r.reduce_attempt == 1
    ins = hz.st.instruction_for("c")
    assert ins.order is Order.REDUCE and [m.worker_id for m in ins.contributors] == ["a", "b", "c"]
    assert ins.reduce_attempt == 1

    assert hz.report("a", h(1)).verdict is Verdict.PENDING
    out = hz.report("b", h(1))  # 2 of 3 > 0.5 x 3: committed
    assert out.verdict is Verdict.COMMITTED
    commits = [e for e in out.effects if isinstance(e, CommitRecord)]
    assert len(commits) == 1 and commits[0].round == 1 and commits[0].agreeing == ("a", "b")
    caps = {m.worker_id: m.max_samples for m in r.members}
    # group_batch x H, split by throughput (micro x accum may round a member's batch up)
    assert 64 * 10 <= sum(caps.values()) <= 66 * 10
    assert commits[0].samples == caps["a"] + caps["b"]  # each reported its budget
    cell = hz.cell()
    assert (cell.committed_round, cell.committed_hash) == (1, h(1))
    assert hz.local("a") == LocalState(CELL, 1, h(1))
    # the next round waits for c, a contributor that has not reported yet
    assert hz.round() is None
    assert out.instruction is not None and out.instruction.order is Order.WAIT
    assert "last contributors report" in out.instruction.reason
    assert hz.hb("a").instruction.order is Order.WAIT  # a heartbeat does not open it either
    assert hz.round() is None
    # c reports a moment after the quorum: it holds the new state and trains round 2
    hz.advance(1_500)
    late = hz.report("c", h(1), round=1, reduce_attempt=1)
    assert late.verdict is Verdict.COMMITTED
    assert hz.local("c") == LocalState(CELL, 1, h(1))
    r2 = hz.round()
    assert r2 is not None and r2.round == 2 and [m.worker_id for m in r2.members] == ["a", "b", "c"]
    assert late.instruction is not None and late.instruction.order is Order.TRAIN and late.instruction.round == 2
    assert hz.st.instruction_for("a").order is Order.TRAIN
    assert hz.store.workers["a"].rounds_contributed == 1


def test_different_hash_is_told_to_resync_from_a_donor() -> None:
    hz = Harness()
    start(hz)
    freeze_all(hz)
    assert hz.report("c", h(9)).verdict is Verdict.PENDING
    hz.report("a", h(1))
    assert hz.report("b", h(1)).verdict is Verdict.COMMITTED
    ins = hz.st.instruction_for("c")
    assert ins.order is Order.SYNC and ins.committed_round == 1 and ins.committed_hash == h(1)
    assert ins.donor is not None and ins.donor.worker_id in ("a", "b")
    assert ins.donor.peer.peer_id == f"peer-{ins.donor.worker_id}"
    assert hz.store.workers["c"].reputation < 0 < hz.store.workers["a"].reputation
    # a duplicate late report with the wrong hash: RESYNC again, nothing else happens
    assert hz.report("c", h(9), round=1, reduce_attempt=1).verdict is Verdict.RESYNC
    hz.sync("c")
    # holding round 1 again while round 2 trains: admitted into it late (tests/test_late_join.py)
    ins = hz.st.instruction_for("c")
    assert ins.order is Order.TRAIN and ins.round == 2 and ins.plan is not None and ins.plan.late_from == 2


def test_donors_are_spread() -> None:
    # one donor per sync (`[sync] max_donors = 1`, what a worker reading only `donor` uses);
    # the named donors of several syncs: tests/test_sync_donors.py
    hz = Harness(replace(make_spec(), sync=SyncSection(max_donors=1)))
    start(hz, "a", "b", "c", "d")
    freeze_all(hz, "a", "b", "c", "d")
    for w in "abcd":
        hz.report(w, h(1), round=1, reduce_attempt=1)
    for w in ("e", "f", "g", "h"):
        hz.reg(w)
    donors = [hz.st.instruction_for(w).donor.worker_id for w in ("e", "f", "g", "h")]  # type: ignore[union-attr]
    assert sorted(donors) == ["a", "b", "c", "d"]  # one syncer per donor
    assert hz.st.instruction_for("e").donor == hz.st.instruction_for("e").donor  # sticky


def test_deadline_freezes_ready_members_and_straggler_sits_out() -> None:
    hz = Harness()
    r = start(hz)
    hz.ready("a")
    hz.ready("b")
    hz.hb("c", Phase.TRAINING, inner_step=2)
    est_before = hz.store.workers["c"].throughput[CELL]
    hz.keepalive(r.deadline_ms, "a", "b", "c")
    r = hz.round()
    # c did not train in time: it still holds the base state, so it takes part in the
    # exchange with zero weight (catch-up) instead of downloading the result afterwards
    assert r.state is RoundState.REDUCING and r.contributors == ("a", "b", "c") and r.catch_up == ("c",)
    ins = hz.st.instruction_for("c")
    assert ins.order is Order.REDUCE and ins.plan is not None and ins.plan.micro_batch == 0
    assert {m.worker_id: m.max_samples for m in ins.contributors}["c"] == 0
    c = hz.store.workers["c"]
    assert c.reputation == -1.0 and c.throughput[CELL] < est_before
    hz.report("a", h(1))
    out = hz.report("b", h(1))  # 2 of 2 weighted contributors: catch-ups do not count
    assert out.verdict is Verdict.COMMITTED
    ins = hz.st.instruction_for("c")  # until its own report arrives: finish the exchange
    assert ins.order is Order.WAIT and "finish its exchange" in ins.reason
    assert hz.report("c", h(1), round=1, reduce_attempt=1, samples=0).verdict is Verdict.COMMITTED
    # a catch-up contributor holds the result too: the next round waited for it
    assert hz.st.instruction_for("c").order is Order.TRAIN
    assert [m.worker_id for m in hz.round().members] == ["a", "b", "c"]
    assert hz.store.commits[-1].samples == sum(m.max_samples for m in r.members if m.worker_id != "c")


def test_catch_up_lets_a_joiner_enter_a_busy_cell() -> None:
    hz = Harness(policy=replace(BAGEL, late_join=False))  # with it, j would train round 2 late
    start(hz, "a", "b")
    freeze_all(hz, "a", "b")
    hz.report("a", h(1))
    hz.report("b", h(1))  # round 2 opens at once with a and b
    hz.reg("j")
    hz.sync("j")  # j fetched round 1 while round 2 trains
    assert hz.st.instruction_for("j").order is Order.WAIT
    r = freeze_all(hz, "a", "b")
    assert r.catch_up == ("j",) and r.contributors == ("a", "b", "j")
    assert hz.st.instruction_for("j").order is Order.REDUCE
    hz.report("j", h(2), samples=0)
    hz.report("a", h(2))
    assert hz.report("b", h(2)).verdict is Verdict.COMMITTED
    assert [m.worker_id for m in hz.round().members] == ["a", "b", "j"]  # no chase
    assert hz.store.workers["j"].rounds_contributed == 0


def test_deadline_without_quorum_aborts_and_reruns_with_survivors() -> None:
    hz = Harness()
    r1 = start(hz)
    hz.ready("a")
    hz.keepalive(r1.deadline_ms - 1, "a", "b", "c")
    hz.now = r1.deadline_ms
    out = hz.tick()
    aborted = [e for e in out.effects if isinstance(e, RoundRecord) and e.attempt == 1]
    assert aborted and aborted[0].state is RoundState.ABORTED and "deadline" in aborted[0].reason
    r2 = hz.round()
    assert (r2.round, r2.attempt, r2.state) == (1, 2, RoundState.OPEN)
    assert [m.worker_id for m in r2.members] == ["a", "b", "c"]
    assert r2.deadline_ms > r1.deadline_ms
    ins = hz.st.instruction_for("a")
    assert ins.order is Order.TRAIN and ins.round_attempt == 2
    # a's READY of the aborted attempt arrives late: ignored, a must train again
    out = hz.hb("a", Phase.READY, samples=640, round_attempt=1)
    assert out.effects == () and "a" not in hz.round().ready
    assert hz.cell().round_attempt == 2
    # too few were ready: the deadline was wrong, not the workers, so nobody loses reputation
    assert [hz.store.workers[w].reputation for w in ("a", "b", "c")] == [0.0, 0.0, 0.0]


def test_lease_expiry_drops_member_and_round_commits_with_rest() -> None:
    hz = Harness()
    start(hz)
    hz.hb("c", Phase.TRAINING, inner_step=1)
    for _ in range(6):  # a and b keep heartbeating, c went silent
        hz.advance(2_000)
        hz.hb("a", Phase.TRAINING)
        hz.hb("b", Phase.TRAINING)
        hz.tick()
    assert hz.store.workers["c"].state is WorkerState.LOST
    r = hz.round()
    assert r.dropped == ("c",) and r.state is RoundState.TRAINING
    hz.ready("a")
    r = freeze_all(hz, "b")
    assert r.contributors == ("a", "b")
    hz.report("a", h(1))
    assert hz.report("b", h(1)).verdict is Verdict.COMMITTED
    with pytest.raises(Exception) as e:
        hz.hb("c")
    assert type(e.value).__name__ == "UnknownWorker"  # it must re-register


def test_contributor_lost_while_reducing_refreezes_survivors() -> None:
    hz = Harness(spec=make_spec(quorum=0.5))
    start(hz, "a", "b", "c", "d")
    freeze_all(hz, "a", "b", "c", "d")
    ins_before = hz.st.instruction_for("a")
    for _ in range(6):
        hz.advance(2_000)
        for w in "abc":
            hz.hb(w, Phase.REDUCING, reduce_attempt=1)
        hz.tick()
    r = hz.round()
    assert r.state is RoundState.REDUCING and r.contributors == ("a", "b", "c") and r.reduce_attempt == 2
    ins = hz.st.instruction_for("a")
    assert ins.order is Order.REDUCE and ins.reduce_attempt == 2 and ins.plan == ins_before.plan
    from bagel.coordinator.core.errors import StaleRound

    with pytest.raises(StaleRound):  # a report over the old contributor set
        hz.report("a", h(1), reduce_attempt=1)
    hz.report("a", h(1))
    assert hz.report("b", h(1)).verdict is Verdict.COMMITTED


def test_contributor_lost_after_a_success_report_does_not_refreeze() -> None:
    hz = Harness()
    start(hz)
    freeze_all(hz)
    hz.report("c", h(1))
    for _ in range(6):
        hz.advance(2_000)
        for w in "ab":
            hz.hb(w, Phase.REDUCING, reduce_attempt=1)
        hz.tick()
    assert hz.store.workers["b"].state is WorkerState.ACTIVE
    r = hz.round()
    # c finished, so nobody lost a part: the attempt stays; a's report commits it (2 > 1.5)
    assert r.reduce_attempt == 1
    assert hz.report("a", h(1)).verdict is Verdict.COMMITTED


def test_refreeze_impossible_aborts_then_reruns() -> None:
    hz = Harness(spec=make_spec(quorum=0.9))
    start(hz, "a", "b")
    freeze_all(hz, "a", "b")
    for _ in range(6):
        hz.advance(2_000)
        hz.hb("a", Phase.REDUCING, reduce_attempt=1)
        hz.tick()
    # 1 survivor of 2 is below ceil(0.9 x 2): abort, re-run with a alone
    r = hz.round()
    assert (r.round, r.attempt, r.state) == (1, 2, RoundState.OPEN) and [m.worker_id for m in r.members] == ["a"]
    # a late report of the aborted contributor set: VERDICT_ABORTED, a harmless no-op
    out = hz.apply(
        __import__("bagel.coordinator.core.events", fromlist=["ReportRound"]).ReportRound(
            "a", CELL, 1, h(1), samples=1, reduce_attempt=1
        )
    )
    assert out.verdict is Verdict.ABORTED and out.effects == ()


def test_reduce_deadline_aborts_and_late_report_gets_aborted() -> None:
    hz = Harness()
    start(hz)
    r = freeze_all(hz)
    hz.now = r.reduce_deadline_ms
    for w in "abc":
        hz.hb(w, Phase.REDUCING, reduce_attempt=1)
    hz.tick()
    r2 = hz.round()
    assert (r2.round, r2.attempt, r2.state) == (1, 2, RoundState.OPEN)
    assert hz.report("a", h(1), round=1, reduce_attempt=1).verdict is Verdict.ABORTED
    # the re-run freezes with reduce_attempt 2: the id is never reused for round 1
    r3 = freeze_all(hz)
    assert r3.reduce_attempt == 2 and r3.first_reduce_attempt == 2
    assert hz.report("a", h(1), reduce_attempt=1).verdict is Verdict.ABORTED


def test_no_quorum_possible_aborts_early() -> None:
    hz = Harness()
    start(hz)
    freeze_all(hz)
    assert hz.report("a", h(1)).verdict is Verdict.PENDING
    assert hz.report("b", h(2)).verdict is Verdict.PENDING
    out = hz.report("c", "", failed=True, reason="peer vanished")
    assert out.verdict is Verdict.ABORTED
    r = hz.round()
    assert (r.round, r.attempt) == (1, 2)
    assert hz.store.workers["c"].reputation == pytest.approx(-0.5)


def test_failed_report_counts_against_quorum_but_commit_still_possible() -> None:
    hz = Harness()
    start(hz, "a", "b", "c", "d", "e")
    freeze_all(hz, "a", "b", "c", "d", "e")
    hz.report("e", "", failed=True, reason="timeout")
    hz.report("a", h(1))
    hz.report("b", h(1))
    assert hz.report("c", h(1)).verdict is Verdict.COMMITTED  # 3 > 2.5
    assert hz.st.instruction_for("e").order is Order.SYNC


def test_checkpoint_upload_every_n_rounds() -> None:
    hz = Harness(spec=make_spec(every_rounds=2))
    start(hz, "a", "b")
    for n in (1, 2):
        commit(hz, n)
        cell = hz.cell()
        if n == 1:
            assert cell.upload_round == -1
    assert cell.upload_round == 2 and cell.uploader in ("a", "b")
    up = cell.uploader
    other = "b" if up == "a" else "a"
    assert hz.st.instruction_for(up).upload_checkpoint
    assert not hz.st.instruction_for(other).upload_checkpoint
    hz.st.check_upload(up, CELL, 2, h(2))
    from bagel.coordinator.core.errors import InvalidRunState

    with pytest.raises(InvalidRunState):
        hz.st.check_upload(other, CELL, 2, h(2))
    with pytest.raises(InvalidRunState):
        hz.st.check_upload(up, CELL, 2, h(3))
    from bagel.coordinator.core.events import CheckpointStored

    with pytest.raises(InvalidRunState):
        hz.apply(CheckpointStored(CELL, 2, h(7)))
    hz.apply(CheckpointStored(CELL, 2, h(2)))
    cell = hz.cell()
    assert (cell.checkpoint_round, cell.checkpoint_hash, cell.upload_round) == (2, h(2), -1)
    assert not hz.st.instruction_for(up).upload_checkpoint
    assert hz.st.check_upload(other, CELL, 2, h(2)) is False  # stored already: nothing to do, no error
    # a worker joining later can fall back to the checkpoint round
    hz.reg("z")
    assert hz.st.instruction_for("z").donor.checkpoint_round == 2  # type: ignore[union-attr]


def test_an_upload_slower_than_a_round_is_not_asked_of_another_holder() -> None:
    """One checkpoint upload per cell at a time: a request that has not landed when the next
    round commits stands (same round, same uploader; its upload is still accepted), and only
    after a whole interval without it is the newest round asked for again. Asking again at
    every commit used to stack uploads on the uplinks and refuse the first when it ended."""
    hz = Harness(spec=make_spec(every_rounds=2))
    start(hz, "a", "b")
    for n in (1, 2):
        commit(hz, n)
    up = hz.cell().uploader
    commit(hz, 3)  # the upload of round 2 is still running
    cell = hz.cell()
    assert (cell.upload_round, cell.uploader) == (2, up)
    assert not any(hz.st.instruction_for(w).upload_checkpoint for w in "ab")  # nobody starts another
    assert hz.st.check_upload(up, CELL, 2, h(2)) is True  # the running one is still the one asked for
    commit(hz, 4)  # a whole interval (2 rounds) without it: presumed lost, the newest round is asked for
    cell = hz.cell()
    assert cell.upload_round == 4 and cell.uploader in ("a", "b")
    assert hz.st.instruction_for(cell.uploader).upload_checkpoint


def test_a_contributor_that_leaves_after_reporting_keeps_its_budget_in_the_reduce() -> None:
    """From the freeze on, each contributor's budget is part of the exchange (the group
    digest binds it). A contributor that reported and then left used to lose its credited
    samples from the round, so a restarted core rebuilt the REDUCE with its plan's budget
    instead: the survivors asking after the restart got another contributor set."""
    from bagel.coordinator.core.events import Leave

    hz = Harness()
    start(hz)
    hz.ready("a", samples=7)  # credited less than planned: its budget is what it was credited
    for w in "bc":
        hz.ready(w)
    rnd = hz.round()
    assert rnd is not None and rnd.state is RoundState.REDUCING
    before = hz.st.instruction_for("b").contributors
    plan = hz.st.instruction_for("b").plan
    assert plan is not None
    cap = next(m.max_samples for m in plan.members if m.worker_id == "a")
    assert next(m.max_samples for m in before if m.worker_id == "a") < cap
    hz.report("a", h(1))
    hz.apply(Leave("a"))
    assert hz.st.instruction_for("b").contributors == before
    assert restored(hz).instruction_for("b").contributors == before


def reported_left_and_came_back(hz: Harness) -> int:
    """a, b and c are frozen; `a` reports, leaves and registers again, still frozen in the
    exchange (its part was delivered). Returns the exchange's reduce attempt."""
    from bagel.coordinator.core.events import Leave

    start(hz)
    freeze_all(hz, "a", "b", "c")
    first = hz.st.instruction_for("b").reduce_attempt
    hz.report("a", h(1))
    hz.apply(Leave("a"))
    hz.reg("a")
    assert {m.worker_id for m in hz.st.instruction_for("b").contributors} == {"a", "b", "c"}
    return first


def test_a_ban_refreezes_an_exchange_its_worker_reported_in_and_then_left() -> None:
    """A contributor that reported and left is dropped from the round but stays in the
    frozen set (its part was delivered). Banned after it came back, it used to stay there:
    the REDUCE kept naming it and the round could commit with its bytes. The ban now
    re-freezes that exchange without it."""
    hz = Harness()
    first = reported_left_and_came_back(hz)
    roster = hz.st.roster
    roster.reputation(roster.workers["a"], -100.0, hz.now, "a lie found elsewhere")
    assert roster.workers["a"].state is WorkerState.BANNED
    ins = hz.st.instruction_for("b")
    assert ins.order is Order.REDUCE and ins.reduce_attempt > first
    assert {m.worker_id for m in ins.contributors} == {"b", "c"}


def test_orphaned_cell_falls_back_to_its_checkpoint() -> None:
    hz = Harness(spec=make_spec(every_rounds=2))
    start(hz, "a", "b")
    for n in (1, 2, 3):
        commit(hz, n)
        if n == 2:
            from bagel.coordinator.core.events import CheckpointStored

            hz.apply(CheckpointStored(CELL, 2, h(2)))
    assert hz.cell().committed_round == 3
    hz.advance(20_000)
    hz.tick()  # both leases expired: nobody holds round 3, but nobody needs it yet
    assert hz.cell().committed_round == 3
    hz.advance(20_000)  # `schedule.orphan_grace_s` (20 s): the holders did not come back
    hz.reg("z")  # z needs the state: fall back to the checkpoint
    cell = hz.cell()
    assert (cell.committed_round, cell.committed_hash, cell.rollbacks) == (2, h(2), 1)
    ins = hz.st.instruction_for("z")
    assert ins.order is Order.SYNC and ins.committed_round == 2
    assert ins.donor is not None and ins.donor.worker_id == "" and ins.donor.checkpoint_round == 2
    assert ins.donors == ()  # no donor list with the checkpoint


def test_a_heartbeat_sent_before_the_verdict_does_not_unseat_the_holder() -> None:
    """The commit makes `a` a holder of round 2; a heartbeat it sent just before it heard
    the verdict still says round 1. That must not drop it from the holders, else the
    next orphan check rolls the cell back under a live holder (seen in chaos-default)."""
    from bagel.coordinator.core.events import Leave
    from bagel.protocol.messages import LocalState

    hz = Harness(spec=make_spec(every_rounds=10))
    start(hz, "a", "b")
    commit(hz, 1)
    commit(hz, 2)
    hz.hb("a", local=LocalState(CELL, 1, h(1)))  # in flight when round 2 committed
    assert hz.local("a") == LocalState(CELL, 2, h(2))
    hz.apply(Leave("b"))  # a is the last holder now
    hz.reg("z")  # needs the state: a is its donor, no fall back
    cell = hz.cell()
    assert (cell.committed_round, cell.rollbacks) == (2, 0)
    z = hz.st.instruction_for("z")
    assert z.order is Order.SYNC and z.donor is not None and z.donor.worker_id == "a"
    # a real regression (a lost its state) still counts once a later commit is not involved
    hz.hb("a", local=LocalState())
    assert hz.local("a") == LocalState()


def test_last_holder_that_offers_uploads_before_leaving_so_nothing_rolls_back() -> None:
    from bagel.coordinator.core.events import CheckpointStored, Leave

    hz = Harness(spec=make_spec(every_rounds=10))
    start(hz, "a", "b")
    commit(hz, 1)
    commit(hz, 2)
    assert (hz.cell().committed_round, hz.cell().checkpoint_round) == (2, -1)
    # not the last holder: it just leaves, offer or not
    assert hz.apply(Leave("a", "sigterm", offer_checkpoint=True)).instruction is None
    assert hz.store.workers["a"].state is WorkerState.LEFT
    # the last holder is asked for the state first, and stays active meanwhile
    out = hz.apply(Leave("b", "sigterm", offer_checkpoint=True))
    ins = out.instruction
    assert (
        ins is not None
        and ins.upload_checkpoint
        and (ins.cell_id, ins.committed_round, ins.committed_hash) == (CELL, 2, h(2))
    )
    assert hz.store.workers["b"].state is WorkerState.ACTIVE
    assert (hz.store.cells[CELL].uploader, hz.store.cells[CELL].upload_round) == ("b", 2)  # durable
    hz.st.check_upload("b", CELL, 2, h(2))  # the server takes its upload
    assert hz.apply(Leave("b", "sigterm", offer_checkpoint=True)).instruction is not None  # asked again: idempotent
    hz.apply(CheckpointStored(CELL, 2, h(2)))
    # now it leaves, and a newcomer that needs the state gets round 2 from the checkpoint
    assert hz.apply(Leave("b", "sigterm", offer_checkpoint=True)).instruction is None
    assert hz.store.workers["b"].state is WorkerState.LEFT
    hz.reg("z")
    cell = hz.cell()
    assert (cell.committed_round, cell.rollbacks) == (2, 0)
    z = hz.st.instruction_for("z")
    assert z.order is Order.SYNC and z.committed_round == 2 and z.donor is not None and z.donor.checkpoint_round == 2


def test_last_holder_that_does_not_offer_leaves_and_the_cell_falls_back() -> None:
    from bagel.coordinator.core.events import Leave

    hz = Harness(spec=make_spec(every_rounds=10))
    start(hz, "a", "b")
    commit(hz, 1)
    hz.apply(Leave("a"))
    assert hz.apply(Leave("b")).instruction is None  # no offer (an old worker, or out of time)
    hz.reg("z")
    cell = hz.cell()
    assert (cell.committed_round, cell.rollbacks) == (0, 1)  # no checkpoint: back to the initial state


def test_leave_during_round_and_duplicate_leave() -> None:
    from bagel.coordinator.core.events import Leave

    hz = Harness()
    start(hz)
    hz.ready("a")
    hz.ready("b")
    out = hz.apply(Leave("c", "ctrl-c"))
    assert hz.store.workers["c"].state is WorkerState.LEFT
    assert hz.round().state is RoundState.REDUCING  # every live member was ready
    assert hz.apply(Leave("c", "again")).effects == ()
    assert out.instruction is None


def test_reregister_rejoins_with_its_state() -> None:
    hz = Harness()
    start(hz, "a", "b")
    commit(hz, 1)
    hz.advance(20_000)
    hz.tick()
    assert hz.store.workers["a"].state is WorkerState.LOST
    hz.reg("a", local=LocalState(CELL, 1, h(1)))
    w = hz.store.workers["a"]
    assert w.state is WorkerState.ACTIVE and w.cell_id == CELL and w.reputation > 0  # history kept
    out = hz.hb("a")
    assert out.instruction.order is Order.TRAIN and out.instruction.round == 2


def test_wait_for_all_aborts_at_deadline_instead_of_freezing() -> None:
    hz = Harness(policy=DILOCO_WAIT_ALL)
    r = start(hz)
    assert len({m.max_samples for m in r.members}) == 1  # equal split
    hz.ready("a")
    hz.ready("b")
    hz.keepalive(r.deadline_ms, "a", "b", "c")
    r2 = hz.round()
    assert (r2.attempt, r2.state) == (2, RoundState.OPEN)


def test_wait_for_all_keeps_a_lost_member_until_the_timeout() -> None:
    hz = Harness(policy=DILOCO_WAIT_ALL)
    r = start(hz)
    hz.ready("a")
    hz.ready("b")
    hz.keepalive(hz.now + 20_000, "a", "b")  # c's lease expired, but the baseline's round waits
    assert hz.store.workers["c"].state is WorkerState.LOST
    assert hz.round().state is RoundState.TRAINING and hz.round().dropped == ()
    hz.keepalive(r.deadline_ms - 1, "a", "b")
    assert hz.round().state is RoundState.TRAINING  # still waiting for c
    hz.keepalive(r.deadline_ms, "a", "b")
    r2 = hz.round()  # at the timeout c is dropped; everyone left is ready
    assert (r2.attempt, r2.state, r2.contributors, r2.dropped) == (1, RoundState.REDUCING, ("a", "b"), ("c",))


def test_sync_dp_rounds_are_single_steps() -> None:
    hz = Harness(policy=SYNC_DP)
    r = start(hz)
    assert r.inner_steps == 1
    assert hz.st.instruction_for("a").plan.inner_steps == 1  # type: ignore[union-attr]


def test_reputation_ban() -> None:
    from bagel.coordinator.core.errors import Banned

    hz = Harness(spec=make_spec(ban_reputation=-3.0))
    start(hz, "a", "b", "x")
    bad = 0
    for n in range(1, 5):  # x disagrees whenever it contributes: -2 each, banned at -3
        r = hz.round()
        freeze_all(hz, *(m.worker_id for m in (*r.members, *r.late)))  # x may have joined late
        if hz.st.instruction_for("x").order is Order.REDUCE:
            hz.report("x", h(100 + n), samples=0)
            bad += 1
        hz.report("a", h(n))
        assert hz.report("b", h(n)).verdict is Verdict.COMMITTED
        if hz.store.workers["x"].state is WorkerState.BANNED:
            break
        hz.sync("x")
    assert bad == 2
    wx = hz.store.workers["x"]
    assert wx.state is WorkerState.BANNED and wx.cell_id == "" and "reputation" in wx.reason
    assert hz.st.instruction_for("x").order is Order.LEAVE
    with pytest.raises(Banned):
        hz.hb("x")
    with pytest.raises(Banned):
        hz.reg("x")


def test_effects_of_a_commit_are_complete_records() -> None:
    hz = Harness()
    start(hz, "a", "b")
    freeze_all(hz, "a", "b")
    hz.report("a", h(1))
    out = hz.report("b", h(1))
    kinds = {type(e).__name__ for e in out.effects}
    assert {"CommitRecord", "RoundRecord", "CellRecord", "WorkerRecord"} <= kinds
    workers = {e.worker_id for e in out.effects if isinstance(e, WorkerRecord)}
    assert workers == {"a", "b"}


def test_lease_expired_event_and_next_wakeup() -> None:
    from bagel.coordinator.core.events import LeaseExpired

    hz = Harness()
    r = start(hz)
    # the earliest timer: the round deadline (6 s) before the leases (10 s)
    assert hz.st.next_wakeup_ms() == r.deadline_ms < hz.now + 10_000
    hz.ready("a")
    hz.ready("b")
    out = hz.apply(LeaseExpired("c"))  # the simulator's shortcut for "c's lease ran out now"
    assert hz.store.workers["c"].state is WorkerState.LOST
    assert hz.round().state is RoundState.REDUCING and hz.round().contributors == ("a", "b")
    assert any(isinstance(e, WorkerRecord) and e.worker_id == "c" for e in out.effects)
    assert hz.apply(LeaseExpired("c")).effects == ()  # already lost: no-op


def test_standby_when_every_cell_is_full_then_placed_on_departure() -> None:
    from bagel.coordinator.core.events import Leave

    hz = Harness(spec=make_spec(max_replicas=2))
    for w in ("a", "b", "s"):
        hz.reg(w)
    assert hz.store.workers["s"].cell_id == ""
    assert hz.st.instruction_for("s").order is Order.WAIT and "standby" in hz.st.instruction_for("s").reason
    hz.apply(Leave("a"))
    assert hz.store.workers["s"].cell_id == CELL


def test_heartbeat_from_a_moved_or_idle_worker_is_harmless() -> None:
    hz = Harness()
    start(hz, "a", "b")
    # a READY for a round/cell that is not the worker's current one changes nothing
    out = hz.hb("a", Phase.READY, cell_id="router", round=7, samples=5)
    assert out.effects == () and out.instruction.order is Order.TRAIN
    out = hz.hb("a", Phase.READY, round=2, samples=5)
    assert out.effects == () and "a" not in hz.st.cell_view(CELL)[1].ready  # type: ignore[union-attr]


def test_relayed_members_reduce_no_part_unless_everyone_is_relayed() -> None:
    """The freeze marks workers that reported RELAYED reachability `no_reduce` (an empty part in
    the split), and binds the marks into the frozen set the evidence check uses; a group of
    relayed workers only reduces with equal parts. Control: the direct members are unmarked."""
    import dataclasses

    from bagel.coordinator.core.events import Register
    from bagel.coordinator.core.scheduler import reduce_nothing
    from bagel.protocol.messages import PeerAddress, Reachability

    from test_state_harness import profile

    hz = Harness()
    for w, reach in (("a", Reachability.DIRECT), ("b", Reachability.RELAYED), ("c", Reachability.UNKNOWN)):
        prof = dataclasses.replace(profile(hz.spec), reachability=reach)
        hz.apply(Register(w, prof, PeerAddress(f"peer-{w}", ("/ip4/127.0.0.1/tcp/1",)), LocalState()))
    hz.hb("a")
    r = freeze_all(hz)
    ins = hz.st.instruction_for("a")
    assert ins.order is Order.REDUCE
    assert {m.worker_id: m.no_reduce for m in ins.contributors} == {"a": False, "b": True, "c": False}
    frozen = hz.st.frozen_set(CELL, r.round, r.attempt, r.reduce_attempt)
    assert frozen is not None and [len(m) for m in frozen] == [3, 4, 3] and frozen[1][3] is True
    assert reduce_nothing(("a", "b"), {"b", "x"}) == {"b"}
    assert reduce_nothing(("a", "b"), {"a", "b"}) == frozenset()
    assert reduce_nothing(("a",), ()) == frozenset()


def test_contributor_floor_opens_no_round_below_it_and_aborts_when_a_member_drop_breaks_it() -> None:
    hz = Harness(spec=make_spec(min_contributors=3))
    three(hz, "a", "b")
    hz.hb("a")
    assert hz.round() is None  # two holders of the committed state: below the floor, nobody trains alone
    r = start(hz, "c")  # the third opens round 1 with all three
    assert [m.worker_id for m in r.members] == ["a", "b", "c"]
    from bagel.coordinator.core.events import Leave

    hz.hb("a", Phase.TRAINING)
    hz.apply(Leave("c"))  # two members left: below the floor
    ended = hz.store.rounds[(CELL, 1, r.attempt)]
    assert ended.state is RoundState.ABORTED and "min_contributors" in ended.reason
    hz.hb("a")
    hz.hb("b")
    hz.tick()
    assert hz.round() is None  # not re-run with the two
    assert hz.st.instruction_for("a").order is Order.WAIT
    hz.reg("d")  # a third holder again (round 0 needs no download): the round re-runs with three
    hz.hb("d")
    r2 = hz.round()
    assert r2 is not None and r2.round == 1 and [m.worker_id for m in r2.members] == ["a", "b", "d"]
    assert not hz.store.commits


def test_contributor_floor_is_checked_by_the_spec() -> None:
    from bagel.protocol.runspec import SpecError

    with pytest.raises(SpecError, match="min_contributors"):
        make_spec(min_contributors=9)  # above max_replicas = 8
    with pytest.raises(SpecError, match="min_contributors"):
        make_spec(min_contributors=0)

"""A cell whose last holder of the committed state lost its lease waits for it to come
back (`schedule.orphan_grace_s`) before it falls back to its checkpoint
(`Rounds.check_orphan`). A network cut a little longer than a lease used to roll the cell
back under holders that were alive, losing committed rounds; a holder that left or was
banned is still not waited for.

Core unit tests under fake time (tests/test_state_harness.py checks every transition's
effects against a fake store).
"""

from __future__ import annotations

from bagel.coordinator.core.events import CheckpointStored, Leave
from bagel.coordinator.core.records import WorkerState
from bagel.protocol.grpc_options import RESTART_REATTACH_MS
from bagel.protocol.messages import LocalState, Order

from test_state_harness import Harness, h, make_spec, restored

CELL = "k0.r0"
LEASE_MS = 10_000
GRACE_MS = 20_000  # the default `schedule.orphan_grace_s`


def commit_three_rounds(hz: Harness) -> None:
    """a and b commit rounds 1 to 3 of the harness's one cell; round 2 is checkpointed."""
    for w in "ab":
        hz.reg(w)
    hz.hb("a")
    for n in (1, 2, 3):
        for w in "ab":
            hz.ready(w)
        for w in "ab":
            hz.report(w, h(n))
        if n == 2:
            hz.apply(CheckpointStored(CELL, 2, h(2)))


def _three_rounds(hz: Harness) -> None:
    """`commit_three_rounds`, then z joins and needs round 3 (it downloads it, slowly: it
    never finishes here)."""
    commit_three_rounds(hz)
    hz.reg("z")
    ins = hz.st.instruction_for("z")
    assert ins.order is Order.SYNC and ins.committed_round == 3 and ins.donor is not None and ins.donor.worker_id


def _cut_off_holders(hz: Harness) -> int:
    """a and b fall silent (a network cut) while z keeps heartbeating, until the tick that
    finds their leases expired; returns its time."""
    while hz.store.workers["b"].state is WorkerState.ACTIVE:
        hz.keepalive(hz.now + 500, "z", step_ms=500)
    assert hz.store.workers["a"].state is WorkerState.LOST and hz.store.workers["b"].state is WorkerState.LOST
    return hz.now


def test_a_holder_back_from_a_cut_longer_than_its_lease_keeps_the_committed_rounds() -> None:
    hz = Harness(make_spec(every_rounds=2))
    _three_rounds(hz)
    _cut_off_holders(hz)
    cell = hz.cell()
    assert (cell.committed_round, cell.rollbacks) == (3, 0)  # not rolled back while it may come back
    ins = hz.st.instruction_for("z")
    assert ins.order is Order.WAIT and ins.committed_round == 3 and "falls back" in ins.reason
    # the cut heals: a registers again with the state it holds and is z's donor
    hz.reg("a", local=LocalState(CELL, 3, h(3)))
    ins = hz.st.instruction_for("z")
    assert ins.order is Order.SYNC and ins.committed_round == 3 and ins.donor is not None and ins.donor.worker_id == "a"
    hz.keepalive(hz.now + GRACE_MS + 2_000, "a", "z")  # the wait's deadline passes: nothing happens
    cell = hz.cell()
    assert (cell.committed_round, cell.committed_hash, cell.rollbacks) == (3, h(3), 0)
    hz.sync("z")
    assert hz.local("z") == LocalState(CELL, 3, h(3))


def test_the_cell_falls_back_once_the_wait_is_over() -> None:
    hz = Harness(make_spec(every_rounds=2))
    _three_rounds(hz)
    lost_at = _cut_off_holders(hz)
    hz.keepalive(lost_at + GRACE_MS - 1, "z", step_ms=1_000)
    assert (hz.cell().committed_round, hz.cell().rollbacks) == (3, 0)
    hz.keepalive(lost_at + GRACE_MS, "z")
    cell = hz.cell()
    assert (cell.committed_round, cell.committed_hash, cell.rollbacks) == (2, h(2), 1)
    ins = hz.st.instruction_for("z")
    assert ins.order is Order.SYNC and ins.committed_round == 2
    assert ins.donor is not None and ins.donor.worker_id == "" and ins.donor.checkpoint_round == 2
    # a holder of the rolled-back round that comes back now holds nothing the cell wants
    hz.reg("a", local=LocalState(CELL, 3, h(3)))
    assert hz.st.instruction_for("a").order is Order.SYNC


def test_a_needer_that_comes_after_the_wait_falls_back_at_once() -> None:
    hz = Harness(make_spec(every_rounds=2))
    commit_three_rounds(hz)
    hz.advance(LEASE_MS + 1)
    hz.tick()  # nobody needs round 3 yet: nothing to fall back for
    hz.advance(GRACE_MS)
    hz.tick()
    assert (hz.cell().committed_round, hz.cell().rollbacks) == (3, 0)  # lazy: nobody needs it
    hz.reg("z")
    assert (hz.cell().committed_round, hz.cell().rollbacks) == (2, 1)


def test_the_last_holder_registering_again_does_not_roll_its_cell_back() -> None:
    """A worker restarted with the same id and state registers again while the last holder
    of its cell: it is detached and placed again in one transition, and the joiner that
    needed the state must not have rolled the cell back in between."""
    hz = Harness(make_spec(orphan_grace_s=0.0))
    _three_rounds(hz)
    hz.apply(Leave("b"))  # a is the last holder
    hz.reg("a", local=LocalState(CELL, 3, h(3)))
    # with no wait the detach rolls the cell back at once, to the checkpoint of round 2
    assert (hz.cell().committed_round, hz.cell().rollbacks) == (2, 1)

    hz = Harness(make_spec())
    _three_rounds(hz)
    hz.apply(Leave("b"))
    hz.reg("a", local=LocalState(CELL, 3, h(3)))
    cell = hz.cell()
    assert (cell.committed_round, cell.rollbacks) == (3, 0)
    ins = hz.st.instruction_for("z")
    assert ins.order is Order.SYNC and ins.donor is not None and ins.donor.worker_id == "a"


def test_a_holder_that_leaves_or_is_banned_is_not_waited_for() -> None:
    hz = Harness(make_spec(every_rounds=2))
    _three_rounds(hz)
    hz.apply(Leave("a"))
    hz.apply(Leave("b"))  # no offer to upload: it will not come back with the state
    assert (hz.cell().committed_round, hz.cell().rollbacks) == (2, 1)

    hz = Harness(make_spec(every_rounds=2))
    _three_rounds(hz)
    hz.apply(Leave("a"))
    roster = hz.st.roster
    roster.reputation(roster.workers["b"], -100.0, hz.now, "a lie")
    assert roster.workers["b"].state is WorkerState.BANNED
    assert (hz.cell().committed_round, hz.cell().rollbacks) == (2, 1)


def test_no_wait_when_the_grace_is_zero() -> None:
    hz = Harness(make_spec(every_rounds=2, orphan_grace_s=0.0))
    _three_rounds(hz)
    _cut_off_holders(hz)
    assert (hz.cell().committed_round, hz.cell().rollbacks) == (2, 1)


def test_a_restarted_coordinator_waits_for_holders_to_re_attach() -> None:
    """After a restart nobody restored may hold a cell's state (its holders were lost
    before the crash) while a worker of the cell needs it: the needer waits, and the cell
    falls back only after the re-attach window and the grace."""
    hz = Harness(make_spec(every_rounds=2))
    _three_rounds(hz)
    _cut_off_holders(hz)
    st = restored(hz)
    assert st.instruction_for("z").order is Order.WAIT
    hz.st = st
    assert st.next_wakeup_ms() is not None
    at = hz.now
    until = at + RESTART_REATTACH_MS + LEASE_MS + GRACE_MS
    hz.keepalive(until - 1_000, "z")
    assert (hz.cell().committed_round, hz.cell().rollbacks) == (3, 0)
    hz.keepalive(until, "z")
    assert (hz.cell().committed_round, hz.cell().rollbacks) == (2, 1)


def test_after_a_restart_a_holder_lost_before_the_crash_is_still_waited_for() -> None:
    """The holders' leases ran out before the coordinator crashed, and nobody needed the
    state then; a joiner that comes right after the restart waits for them too."""
    hz = Harness(make_spec(every_rounds=2))
    commit_three_rounds(hz)
    hz.advance(LEASE_MS + 1)
    hz.tick()  # a and b lost; nobody needs round 3 yet
    hz.advance(GRACE_MS + 1)  # the wait of their loss is over (and volatile anyway)
    hz.st = restored(hz)
    hz.reg("z")
    assert (hz.cell().committed_round, hz.cell().rollbacks) == (3, 0)
    assert hz.st.instruction_for("z").order is Order.WAIT
    hz.reg("a", local=LocalState(CELL, 3, h(3)))  # a comes back with the state
    ins = hz.st.instruction_for("z")
    assert ins.order is Order.SYNC and ins.donor is not None and ins.donor.worker_id == "a"
    assert hz.cell().rollbacks == 0

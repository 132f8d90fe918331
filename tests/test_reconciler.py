"""The worker's reconciler (worker/reconciler.py): every instruction x every local state.

`decide` is the real worker's decisions, shared with the simulator, the test workers and
the load generator; these tables pin them down. Pure: no I/O, milliseconds.

The cell is k0 with round 3 committed (hash h3); the instructions are about round 4,
attempt 2, and the freeze is reduce_attempt 2. "me" is the worker deciding.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.convert import instruction_from_pb, instruction_to_pb, order_from_pb, verdict_from_pb
from bagel.protocol.messages import (
    Donor,
    Instruction,
    LocalState,
    Member,
    Order,
    PeerAddress,
    Phase,
    RoundPlan,
    Verdict,
)
from bagel.worker.reconciler import (
    AdoptPending,
    BuildInitialState,
    CancelSync,
    DropWork,
    Leave,
    NotAMember,
    ReportMissing,
    ReReport,
    StartCatchUp,
    StartReduce,
    StartSync,
    StartTrain,
    Sync,
    Upload,
    Work,
    WorkerView,
    decide,
    decide_verdict,
    holds,
    phase,
)

ME = "w-me"
CELL = "k0"
DONOR = Donor("w-donor", PeerAddress("12D3KooWdonor", ("/ip4/10.0.0.1/tcp/1",)), checkpoint_round=2)


def member(wid: str, max_samples: int = 80) -> Member:
    return Member(wid, PeerAddress(f"peer-{wid}"), max_samples)


PLAN = RoundPlan(5, 8, 2, 1_000, (member("w-a"), member(ME)))  # me: data shard 1
BASE = {"cell_id": CELL, "round": 4, "committed_round": 3, "committed_hash": "h3"}

INSTRUCTIONS = {
    "wait": Instruction(Order.WAIT, **BASE),
    "sync": Instruction(Order.SYNC, **BASE, donor=DONOR),
    "train": Instruction(Order.TRAIN, **BASE, plan=PLAN, round_attempt=2),
    "reduce": Instruction(
        Order.REDUCE, **BASE, plan=PLAN, contributors=(member("w-a"), member(ME)), reduce_attempt=2, round_attempt=2
    ),
    "reduce-catch-up": Instruction(
        Order.REDUCE, **BASE, plan=PLAN, contributors=(member("w-a"), member(ME, 0)), reduce_attempt=2, round_attempt=2
    ),
    "leave": Instruction(Order.LEAVE, reason="banned"),
    "upload": Instruction(Order.WAIT, **BASE, upload_checkpoint=True),
}

HOLD = LocalState(CELL, 3, "h3")  # the committed state
OLD = LocalState(CELL, 2, "h2")  # the one before
STATES = {
    "nothing": WorkerView(ME),
    "holds-committed": WorkerView(ME, HOLD),
    "holds-older": WorkerView(ME, OLD),
    "holds-other-cell": WorkerView(ME, LocalState("k1", 3, "x3")),
    "training-same": WorkerView(ME, HOLD, Work(CELL, 4, 2)),
    "training-other-attempt": WorkerView(ME, HOLD, Work(CELL, 4, 1)),
    "ready": WorkerView(ME, HOLD, Work(CELL, 4, 2, ready=True)),
    "reducing-same": WorkerView(ME, HOLD, Work(CELL, 4, 2, ready=True, reduce_attempt=2, exchanging=True)),
    "reducing-older": WorkerView(ME, HOLD, Work(CELL, 4, 2, ready=True, reduce_attempt=1, exchanging=True)),
    # reported round 4, waiting for its commit
    "pending-here": WorkerView(
        ME, HOLD, Work(CELL, 4, 2, ready=True, reduce_attempt=2, pending_hash="h4", pending_attempt=2)
    ),
    # reported round 3: the instruction shows it committed with our hash / with another one
    "pending-committed": WorkerView(
        ME, OLD, Work(CELL, 3, 1, ready=True, reduce_attempt=1, pending_hash="h3", pending_attempt=1)
    ),
    "pending-other-hash": WorkerView(
        ME, OLD, Work(CELL, 3, 1, ready=True, reduce_attempt=1, pending_hash="hX", pending_attempt=1)
    ),
    "syncing-same": WorkerView(ME, OLD, sync=Sync(HOLD)),
    "syncing-other": WorkerView(ME, None, sync=Sync(LocalState("k1", 5, "y5"))),
}

ADOPT = AdoptPending()
CANCEL = CancelSync()
SYNC = StartSync(CELL, 3, "h3", DONOR)
TRAIN = StartTrain(1)
CATCH = StartCatchUp()
REDUCE = StartReduce(2, 2)  # both contributors weighted
REDUCE_1 = StartReduce(2, 1)  # w-a weighted, me catching up
MISSING = ReportMissing(CELL, 4, 2, 2)
UPLOAD = Upload(CELL, 3, "h3")
LEAVE = Leave("banned")
WAIT_DROP = DropWork("ordered to wait")
OTHER_HASH = DropWork("round 3 committed with another hash")
SYNCED = DropWork("synced")
NEW_ROUND = DropWork("a new round")
CATCHING_UP = DropWork("catching up through the exchange")

# expected actions: instruction -> state -> actions (in order)
EXPECTED: dict[str, dict[str, tuple[object, ...]]] = {
    "wait": {
        "nothing": (),
        "holds-committed": (),
        "holds-older": (),
        "holds-other-cell": (),
        "training-same": (WAIT_DROP,),
        "training-other-attempt": (WAIT_DROP,),
        "ready": (WAIT_DROP,),
        "reducing-same": (WAIT_DROP,),
        "reducing-older": (WAIT_DROP,),
        "pending-here": (WAIT_DROP,),
        "pending-committed": (ADOPT,),
        "pending-other-hash": (OTHER_HASH,),
        "syncing-same": (CANCEL,),
        "syncing-other": (CANCEL,),
    },
    "sync": {
        "nothing": (SYNC,),
        "holds-committed": (),
        "holds-older": (SYNC,),
        "holds-other-cell": (SYNC,),
        "training-same": (SYNCED,),
        "training-other-attempt": (SYNCED,),
        "ready": (SYNCED,),
        "reducing-same": (SYNCED,),
        "reducing-older": (SYNCED,),
        "pending-here": (SYNCED,),
        "pending-committed": (ADOPT,),
        "pending-other-hash": (OTHER_HASH, SYNC),
        "syncing-same": (),
        "syncing-other": (CANCEL, SYNC),
    },
    "train": {
        # not holding the committed state (round > 0): nothing to train from
        "nothing": (),
        "holds-committed": (TRAIN,),
        "holds-older": (),
        "holds-other-cell": (),
        "training-same": (),
        "training-other-attempt": (NEW_ROUND, TRAIN),
        "ready": (),
        "reducing-same": (),
        "reducing-older": (),
        "pending-here": (),
        "pending-committed": (ADOPT, TRAIN),
        "pending-other-hash": (OTHER_HASH,),
        # finishing a sync of the committed state first: the coordinator will see the new
        # LocalState; a sync of anything else is dropped (nothing to train from yet: round 3)
        "syncing-same": (),
        "syncing-other": (CANCEL,),
    },
    "reduce": {
        # a weighted contributor without its contribution says so
        "nothing": (MISSING,),
        "holds-committed": (MISSING,),
        "holds-older": (MISSING,),
        "holds-other-cell": (MISSING,),
        "training-same": (),
        "training-other-attempt": (MISSING,),
        "ready": (REDUCE,),
        "reducing-same": (),
        "reducing-older": (REDUCE,),
        "pending-here": (),
        "pending-committed": (ADOPT, MISSING),
        "pending-other-hash": (OTHER_HASH, MISSING),
        "syncing-same": (),
        "syncing-other": (),
    },
    "reduce-catch-up": {
        "nothing": (),
        "holds-committed": (CATCH, REDUCE_1),
        "holds-older": (),
        "holds-other-cell": (),
        "training-same": (CATCHING_UP, CATCH, REDUCE_1),
        "training-other-attempt": (CATCHING_UP, CATCH, REDUCE_1),
        "ready": (CATCHING_UP, CATCH, REDUCE_1),
        "reducing-same": (CATCHING_UP, CATCH, REDUCE_1),
        "reducing-older": (CATCHING_UP, CATCH, REDUCE_1),
        "pending-here": (CATCHING_UP, CATCH, REDUCE_1),
        "pending-committed": (ADOPT, CATCH, REDUCE_1),
        "pending-other-hash": (OTHER_HASH,),
        "syncing-same": (),
        "syncing-other": (),
    },
    # (a LEAVE names no cell: no pending round can be settled by it)
    "leave": {state: (LEAVE,) for state in STATES},
    "upload": {
        "nothing": (),
        "holds-committed": (UPLOAD,),
        "holds-older": (),
        "holds-other-cell": (),
        "training-same": (UPLOAD, WAIT_DROP),
        "training-other-attempt": (UPLOAD, WAIT_DROP),
        "ready": (UPLOAD, WAIT_DROP),
        "reducing-same": (UPLOAD, WAIT_DROP),
        "reducing-older": (UPLOAD, WAIT_DROP),
        "pending-here": (UPLOAD, WAIT_DROP),
        "pending-committed": (ADOPT, UPLOAD),
        "pending-other-hash": (OTHER_HASH,),
        "syncing-same": (CANCEL,),
        "syncing-other": (CANCEL,),
    },
}


def test_the_table_covers_every_instruction_and_state() -> None:
    assert set(EXPECTED) == set(INSTRUCTIONS)
    for name, row in EXPECTED.items():
        assert set(row) == set(STATES), name


@pytest.mark.parametrize(("instruction", "state"), [(i, s) for i in INSTRUCTIONS for s in STATES], ids=lambda x: x)
def test_decide(instruction: str, state: str) -> None:
    view = STATES[state]
    assert decide(INSTRUCTIONS[instruction], view) == EXPECTED[instruction][state]
    assert view == STATES[state]  # (frozen: nothing to mutate, and nothing kept between calls)


# ---------------------------------------------------------------------------- the edges of each order

ROUND0 = {"cell_id": CELL, "round": 1, "committed_round": 0, "committed_hash": ""}


@pytest.mark.parametrize(
    ("instruction", "view", "expected"),
    [
        # round 0 is built locally, then trained (whatever was held before)
        (Instruction(Order.TRAIN, **ROUND0, plan=PLAN), WorkerView(ME), (BuildInitialState(CELL), TRAIN)),
        (
            Instruction(Order.TRAIN, **ROUND0, plan=PLAN),
            WorkerView(ME, LocalState("k1", 7, "x7"), Work("k1", 8, 1, ready=True)),
            (BuildInitialState(CELL), NEW_ROUND, TRAIN),
        ),
        # round 0 held (its real hash; "" on the wire) is held
        (Instruction(Order.TRAIN, **ROUND0, plan=PLAN), WorkerView(ME, LocalState(CELL, 0, "real")), (TRAIN,)),
        # a SYNC of round 0 is a local build too (StartSync with hash "")
        (Instruction(Order.SYNC, **ROUND0), WorkerView(ME), (StartSync(CELL, 0, "", None),)),
        (Instruction(Order.SYNC, **ROUND0), WorkerView(ME, LocalState(CELL, 0, "real")), ()),
        # a plan that does not list us (a stale answer): warn, do nothing
        (
            Instruction(Order.TRAIN, **BASE, plan=replace(PLAN, members=(member("w-a"),)), round_attempt=2),
            WorkerView(ME, HOLD),
            (NotAMember(),),
        ),
        (Instruction(Order.TRAIN, **BASE, round_attempt=2), WorkerView(ME, HOLD), (NotAMember(),)),
        # a REDUCE that does not name us: not ours
        (replace(INSTRUCTIONS["reduce"], contributors=(member("w-a"),)), STATES["ready"], ()),
        # a lost contribution is reported once, and not at all once the round is held or while syncing
        (INSTRUCTIONS["reduce"], replace(STATES["holds-committed"], missing_reported=frozenset({(CELL, 4, 2, 2)})), ()),
        (INSTRUCTIONS["reduce"], WorkerView(ME, LocalState(CELL, 4, "h4")), ()),
        # the coordinator came back after an outage: the pending report may be lost, send it again
        (
            INSTRUCTIONS["reduce"],
            WorkerView(ME, HOLD, replace(STATES["pending-here"].work, report_stale=True)),
            (ReReport(),),
        ),
        # ... unless that report is still being sent
        (
            INSTRUCTIONS["reduce"],
            WorkerView(ME, HOLD, replace(STATES["pending-here"].work, report_stale=True, exchanging=True)),
            (),
        ),
        # a re-freeze names us again: only the exchange is redone
        (replace(INSTRUCTIONS["reduce"], reduce_attempt=3), STATES["pending-here"], (StartReduce(3, 2),)),
        # a failed exchange (no pending outcome) waits for a re-freeze or an abort
        (INSTRUCTIONS["reduce"], WorkerView(ME, HOLD, Work(CELL, 4, 2, ready=True, reduce_attempt=2)), ()),
        # a catch-up contribution, re-frozen: the kept zero delta is exchanged again
        (
            INSTRUCTIONS["reduce-catch-up"],
            WorkerView(ME, HOLD, Work(CELL, 4, 2, ready=True, catch_up=True, reduce_attempt=1)),
            (REDUCE_1,),
        ),
        (
            INSTRUCTIONS["reduce-catch-up"],
            WorkerView(ME, HOLD, Work(CELL, 4, 2, ready=True, catch_up=True, reduce_attempt=2)),
            (),
        ),
        # a catch-up at round 0: the coordinator counts every worker of the cell as holding
        # the initial state, so the worker builds it (instant) and joins the exchange
        (
            Instruction(
                Order.REDUCE, **ROUND0, plan=PLAN, contributors=(member("w-a"), member(ME, 0)), reduce_attempt=1
            ),
            WorkerView(ME),
            (BuildInitialState(CELL), CATCH, StartReduce(1, 1)),
        ),
        # ... but not while it syncs (a sync names the state it will hold)
        (
            Instruction(
                Order.REDUCE, **ROUND0, plan=PLAN, contributors=(member("w-a"), member(ME, 0)), reduce_attempt=1
            ),
            WorkerView(ME, sync=Sync(LocalState("k1", 5, "y5"))),
            (),
        ),
        # TRAIN at round 0 while syncing another cell: the stale sync goes, the initial state is built
        (
            Instruction(Order.TRAIN, **ROUND0, plan=PLAN, round_attempt=1),
            WorkerView(ME, sync=Sync(LocalState("k1", 5, "y5"))),
            (CANCEL, BuildInitialState(CELL), TRAIN),
        ),
        # uploads: once per (cell, round), only what we hold, never round 0
        (INSTRUCTIONS["upload"], replace(STATES["holds-committed"], uploaded=frozenset({(CELL, 3)})), ()),
        (Instruction(Order.WAIT, **ROUND0, upload_checkpoint=True), WorkerView(ME, LocalState(CELL, 0, "real")), ()),
        (replace(INSTRUCTIONS["sync"], upload_checkpoint=True), STATES["holds-committed"], (UPLOAD,)),
        # an order this worker does not know: nothing (but a reported round can still commit)
        (Instruction(Order.UNSPECIFIED, **BASE), STATES["training-same"], ()),
        (Instruction(Order.UNSPECIFIED, **BASE), STATES["pending-committed"], (ADOPT,)),
        # our exchange of the round that just committed is still running: it finishes (its
        # outcome is the committed state) instead of a download; not once it has failed or
        # reported another outcome, nor for an older round
        (
            INSTRUCTIONS["sync"],
            WorkerView(ME, OLD, Work(CELL, 3, 1, ready=True, catch_up=True, reduce_attempt=1, exchanging=True)),
            (),
        ),
        (
            INSTRUCTIONS["sync"],
            WorkerView(ME, OLD, Work(CELL, 3, 1, ready=True, catch_up=True, reduce_attempt=1)),
            (DropWork("resync"), SYNC),
        ),
        (
            INSTRUCTIONS["sync"],
            WorkerView(ME, OLD, Work(CELL, 2, 1, ready=True, reduce_attempt=1, exchanging=True)),
            (DropWork("resync"), SYNC),
        ),
        # a pending round of another cell is not settled by this cell's instruction
        (
            INSTRUCTIONS["wait"],
            WorkerView(ME, OLD, replace(STATES["pending-committed"].work, cell_id="k9")),
            (WAIT_DROP,),
        ),
    ],
)
def test_decide_edges(instruction: Instruction, view: WorkerView, expected: tuple[object, ...]) -> None:
    assert decide(instruction, view) == expected


# ---------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize(
    ("verdict", "reported_outcome", "current", "expected"),
    [
        (Verdict.COMMITTED, True, True, (ADOPT,)),
        (Verdict.COMMITTED, False, True, ()),  # a failed exchange has no outcome to adopt
        (Verdict.COMMITTED, True, False, ()),  # that work was dropped meanwhile
        (Verdict.PENDING, True, True, ()),  # the commit shows up in a later instruction
        (Verdict.RESYNC, True, True, (DropWork("VERDICT_RESYNC"),)),
        (Verdict.RESYNC, True, False, ()),
        (Verdict.ABORTED, False, True, (DropWork("VERDICT_ABORTED"),)),
        (Verdict.ABORTED, True, False, ()),
        (Verdict.UNSPECIFIED, True, True, ()),
        (None, True, True, ()),
    ],
)
def test_decide_verdict(
    verdict: Verdict | None, reported_outcome: bool, current: bool, expected: tuple[object, ...]
) -> None:
    assert decide_verdict(verdict, reported_outcome=reported_outcome, current=current) == expected


def test_holds() -> None:
    assert holds(HOLD, CELL, 3, "h3")
    assert not holds(HOLD, CELL, 3, "h4") and not holds(HOLD, CELL, 2, "h3") and not holds(HOLD, "k1", 3, "h3")
    assert not holds(None, CELL, 0, "")
    assert holds(LocalState(CELL, 0, "real"), CELL, 0, "") and holds(LocalState(CELL, 0, "real"), CELL, 0, "real")
    assert not holds(LocalState(CELL, 0, "real"), CELL, 0, "other")


# ---------------------------------------------------------------------------- what the worker reads off the wire


@pytest.mark.parametrize("name", list(INSTRUCTIONS))
def test_instructions_survive_the_wire(name: str) -> None:
    """The worker decides on exactly what the coordinator meant to send."""
    ins = INSTRUCTIONS[name]
    assert instruction_from_pb(instruction_to_pb(ins)) == ins


def test_unknown_enum_numbers_read_as_unspecified() -> None:
    assert instruction_from_pb(pb.Instruction(order=99)).order is Order.UNSPECIFIED  # type: ignore[arg-type]
    assert order_from_pb(pb.ORDER_REDUCE) is Order.REDUCE
    assert verdict_from_pb(pb.VERDICT_COMMITTED) is Verdict.COMMITTED and verdict_from_pb(42) is Verdict.UNSPECIFIED


# ---------------------------------------------------------------------------- heartbeat phase

PHASES = {
    "nothing": Phase.IDLE,
    "holds-committed": Phase.IDLE,
    "holds-older": Phase.IDLE,
    "holds-other-cell": Phase.IDLE,
    "training-same": Phase.TRAINING,
    "training-other-attempt": Phase.TRAINING,
    "ready": Phase.READY,
    "reducing-same": Phase.REDUCING,
    "reducing-older": Phase.REDUCING,
    "pending-here": Phase.REDUCING,
    "pending-committed": Phase.REDUCING,
    "pending-other-hash": Phase.REDUCING,
    "syncing-same": Phase.SYNCING,
    "syncing-other": Phase.SYNCING,
}


@pytest.mark.parametrize("state", sorted(STATES))
def test_the_heartbeat_phase_of_every_local_state(state: str) -> None:
    assert set(PHASES) == set(STATES)
    assert phase(STATES[state]) is PHASES[state]


# ---------------------------------------------------------------- steps trained ahead (overlap)

AHEAD = dict(cell_id=CELL, base_round=3, member_index=1, members=2, steps=3)


def _train_with(ahead: object) -> StartTrain:
    from bagel.worker.reconciler import Ahead

    view = WorkerView(ME, held=HOLD, ahead=Ahead(**ahead) if ahead is not None else None)  # type: ignore[arg-type]
    acts = decide(INSTRUCTIONS["train"], view)
    assert len(acts) == 1 and isinstance(acts[0], StartTrain)
    return acts[0]


def test_steps_trained_ahead_count_toward_the_round_whose_plan_they_guessed() -> None:
    assert _train_with(AHEAD) == StartTrain(1, 3)
    assert _train_with({**AHEAD, "steps": 5}).ahead_steps == 5  # the whole round
    # the plan's batch shape is not looked at; the shard moved with the group: they count
    assert _train_with({**AHEAD, "member_index": 0}).ahead_steps == 3
    assert _train_with({**AHEAD, "members": 3}).ahead_steps == 3
    assert _train_with(None).ahead_steps == 0


@pytest.mark.parametrize(
    "change",
    [
        {"base_round": 2},  # overlapped an older exchange: its outcome is not this round's base
        {"cell_id": "k1"},  # another cell's steps
        {"steps": 6},  # more steps than the plan has: they cannot be undone
    ],
)
def test_steps_trained_ahead_for_another_plan_are_discarded(change: dict[str, object]) -> None:
    assert _train_with({**AHEAD, **change}).ahead_steps == 0


def test_steps_trained_ahead_need_the_committed_base_held() -> None:
    from bagel.worker.reconciler import Ahead, steps_ahead

    ahead = Ahead(**AHEAD)  # type: ignore[arg-type]
    i = INSTRUCTIONS["train"]
    assert steps_ahead(ahead, i, 1, HOLD) == 3
    assert steps_ahead(ahead, i, 1, LocalState(CELL, 3, "h3-other")) == 0  # another outcome
    assert steps_ahead(ahead, i, 1, None) == 0
    assert steps_ahead(ahead, replace(i, round=5), 1, HOLD) == 0  # not the round right after


def test_a_download_the_cell_committed_past_once_finishes_and_then_catches_up() -> None:
    """Downloading round 2 when round 3 commits: with catch-up by the updates on, the
    download goes on (its donors still serve round 2), and the worker then holds round 2
    and catches up by round 3's update; without it, or two rounds past, it starts again."""
    syncing_old = WorkerView(ME, None, sync=Sync(OLD), catch_up_rounds=2)
    assert decide(INSTRUCTIONS["sync"], syncing_old) == ()
    assert decide(INSTRUCTIONS["sync"], replace(syncing_old, catch_up_rounds=0)) == (CANCEL, SYNC)
    two_past = replace(syncing_old, sync=Sync(LocalState(CELL, 1, "h1")))
    assert decide(INSTRUCTIONS["sync"], two_past) == (CANCEL, SYNC)
    other_cell = replace(syncing_old, sync=Sync(LocalState("k1", 2, "x2")))
    assert decide(INSTRUCTIONS["sync"], other_cell) == (CANCEL, SYNC)
    # a failed download (no longer running) is retried toward the new round
    assert decide(INSTRUCTIONS["sync"], replace(syncing_old, sync=Sync(OLD, running=False))) == (CANCEL, SYNC)
    # when it finishes it holds round 2: told to sync round 3, it starts that (the catch-up)
    assert decide(INSTRUCTIONS["sync"], WorkerView(ME, OLD, catch_up_rounds=2)) == (SYNC,)

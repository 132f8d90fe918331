"""What a worker does about the coordinator's current instruction: one pure function.

The round protocol is level-triggered: every Register/Heartbeat/ReportRound answer carries
the worker's current `Instruction`, and the worker compares it with what it holds and is
doing, then acts. A lost message or a coordinator restart changes nothing, because the
next answer says the same thing again. `decide` is that comparison, and nothing else: no
I/O, no clock, no asyncio, no torch. It is shared by everything that plays a worker:

- the real worker (`worker/agent.py`), which performs the actions with real training,
  exchanges and downloads;
- the discrete-event simulator's synthetic workers (`sim/discrete/workers.py`);
- the test suite's gRPC workers (`tests/simworkers.py`) and the coordinator load
  generator (`bench/coordinator_load.py`), which fake the heavy parts with sleeps.

`decide(instruction, view)` returns the actions in the order they are to be performed;
the later ones assume the earlier ones happened (after `AdoptPending` the view holds the
new state, after `DropWork` there is no work). A caller that fails to perform one (a
failed local build, an instruction replaced while a model was being built) skips the
rest: the next instruction is reconciled afresh. `decide_verdict` is the same for the
answer to a ReportRound.

The committed state is only replaced by a verified sync or a commit (`AdoptPending`), so
dropping work at any point (WAIT, a new attempt, ABORTED, RESYNC) is a rollback for free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bagel.protocol.fastinit import fast_init
from bagel.protocol.messages import Donor, Instruction, LocalState, Member, Order, Phase, Verdict

# ---------------------------------------------------------------- what the worker holds and does


@fast_init
@dataclass(frozen=True, slots=True)
class Work:
    """The one round the worker is working on: training, ready, exchanging or reported."""

    cell_id: str
    round: int
    round_attempt: int
    ready: bool = False  # trained: its pseudo-gradient exists (catch-up work is ready at once)
    catch_up: bool = False  # a zero-weight contribution: trained nothing, only applies the average
    reduce_attempt: int = 0  # the contributor set being / last exchanged over (0 = none yet)
    exchanging: bool = False  # the exchange, or the report of its outcome, is still running
    pending_hash: str | None = None  # reported outcome waiting for the commit
    pending_attempt: int = 0  # the reduce_attempt that outcome was exchanged over
    report_stale: bool = False  # the coordinator came back after an outage since that report

    def matches(self, cell_id: str, round: int, round_attempt: int) -> bool:
        return self.cell_id == cell_id and self.round == round and self.round_attempt == round_attempt


@fast_init
@dataclass(frozen=True, slots=True)
class Sync:
    """A download of (cell, committed round, committed hash) in flight."""

    target: LocalState
    running: bool = True


@fast_init
@dataclass(frozen=True, slots=True)
class Ahead:
    """Inner steps trained ahead (`[diloco] overlap = "delayed"`): while the exchange of
    `base_round` ran, the worker went on training, from its own trained weights, the round
    after it on the guess that its plan repeats the last one (same data shard, same batch
    shape). Those steps count toward round `base_round + 1` if its base is the outcome of
    that very exchange; the shell then moves them onto the committed base (the delayed
    outer update). The plan may differ from the guess: the batch shape moves with the
    coordinator's throughput estimates, and the data shard (member index, group size)
    whenever a member joins or leaves the cell, which in a large volunteer cell is most
    rounds. The round's other steps then take the new shape and the new shard (from its
    first sample), and the reported samples stay within the new budget."""

    cell_id: str
    base_round: int
    member_index: int
    members: int
    steps: int  # inner steps trained ahead so far


@fast_init
@dataclass(frozen=True, slots=True)
class WorkerView:
    """Everything `decide` looks at: the worker's committed state, its work, its sync, and
    what it already did about earlier instructions (so it does not do it twice)."""

    worker_id: str
    held: LocalState | None = None  # committed state held locally (its real hash, also at round 0)
    work: Work | None = None
    sync: Sync | None = None
    uploaded: frozenset[tuple[str, int]] = field(default_factory=frozenset)  # (cell, round) uploaded / uploading
    missing_reported: frozenset[tuple[str, int, int, int]] = field(default_factory=frozenset)
    ahead: Ahead | None = None
    catch_up_rounds: int = 0  # the run spec's `[sync] catch_up_rounds` (0: never by the updates)


def holds(held: LocalState | None, cell_id: str, committed_round: int, committed_hash: str) -> bool:
    """Does the worker hold that committed state? Round 0 is the deterministic initial
    state, whose committed hash is "" on the wire."""
    if held is None or held.cell_id != cell_id or held.committed_round != committed_round:
        return False
    return committed_hash == held.state_hash or (committed_round == 0 and committed_hash == "")


def phase(view: WorkerView) -> Phase:
    """What the worker's heartbeat says it is doing: syncing, idle, training, ready (its
    pseudo-gradient exists) or reducing (an exchange over a frozen set ran or runs, or its
    outcome awaits the verdict)."""
    if view.sync is not None:
        return Phase.SYNCING
    w = view.work
    if w is None:
        return Phase.IDLE
    if w.reduce_attempt or w.pending_hash is not None:
        return Phase.REDUCING
    return Phase.READY if w.ready else Phase.TRAINING


# ---------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Leave:
    """Banned, or the run is over: leave gracefully and exit."""

    reason: str


@fast_init
@dataclass(frozen=True, slots=True)
class Upload:
    """Stream the committed state held to UploadCheckpoint (in the background)."""

    cell_id: str
    committed_round: int
    committed_hash: str


@fast_init
@dataclass(frozen=True, slots=True)
class AdoptPending:
    """The reported round committed with our hash: its outcome becomes the committed state."""


@fast_init
@dataclass(frozen=True, slots=True)
class DropWork:
    """Abandon the current round (training, ready, exchanging or reported)."""

    why: str


@fast_init
@dataclass(frozen=True, slots=True)
class CancelSync:
    """Stop the download in flight."""


@fast_init
@dataclass(frozen=True, slots=True)
class StartSync:
    """Fetch (cell, committed round) from the donors (several at once, else the one donor),
    else the coordinator's checkpoint, and verify the committed hash; round 0 (hash "") is
    built locally instead."""

    cell_id: str
    committed_round: int
    committed_hash: str
    donor: Donor | None
    donors: tuple[Donor, ...] = ()  # the coordinator's list, best first (empty: an older coordinator)


@fast_init
@dataclass(frozen=True, slots=True)
class BuildInitialState:
    """Round 0 of a TRAIN or a catch-up: build the deterministic initial state locally, at
    once (the actions after it assume it is held; if the build fails, skip them)."""

    cell_id: str


@fast_init
@dataclass(frozen=True, slots=True)
class StartTrain:
    """Train the instruction's round per its plan, as data shard `member_index`; the first
    `ahead_steps` inner steps are the ones trained ahead (`Ahead`), and 0 discards any."""

    member_index: int
    ahead_steps: int = 0


@dataclass(frozen=True, slots=True)
class NotAMember:
    """Told to train a round whose plan does not list us (a stale answer): warn, wait."""


@fast_init
@dataclass(frozen=True, slots=True)
class StartCatchUp:
    """Become a catch-up contributor of the instruction's round: we hold its base state but
    trained nothing, so we exchange a zero pseudo-gradient (weight 0) and apply the same
    outer step, and hold the new state without a download."""


@fast_init
@dataclass(frozen=True, slots=True)
class StartReduce:
    """Exchange the pseudo-gradient with exactly the instruction's contributors, then the
    outer step and ReportRound. A re-freeze redoes only the exchange, with the kept delta."""

    reduce_attempt: int
    contributors: int  # weighted contributors (catch-up ones excluded)


@dataclass(frozen=True, slots=True)
class ReReport:
    """Send the pending report again: the coordinator restarted since, and may have lost it."""


@dataclass(frozen=True, slots=True)
class ReportMissing:
    """We are a weighted contributor but lost our contribution (restart): report it failed,
    so the coordinator re-freezes without us instead of waiting for its deadline."""

    cell_id: str
    round: int
    round_attempt: int
    reduce_attempt: int


Action = (
    Leave
    | Upload
    | AdoptPending
    | DropWork
    | CancelSync
    | StartSync
    | BuildInitialState
    | StartTrain
    | NotAMember
    | StartCatchUp
    | StartReduce
    | ReReport
    | ReportMissing
)


# ---------------------------------------------------------------- the decisions


class _Contributors:
    """REDUCE contributor tuples indexed by worker id, with how many are weighted. Every
    member of an exchange is handed the same tuple object (the simulator's thirty members
    of a group each decide on it, interleaved with other groups), so the indexes of the
    last `KEEP` tuples are kept, by identity, and a REDUCE is read in O(1) instead of a
    scan per member; another tuple (the real worker's, new with each answer) is indexed
    afresh. The first entry of a worker id wins, as a scan would find it. A kept index
    holds its tuple, so its id cannot be reused while it is kept."""

    KEEP = 64

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[int, tuple[tuple[Member, ...], dict[str, Member], int]] = {}

    def index(self, contributors: tuple[Member, ...]) -> tuple[dict[str, Member], int]:
        """(worker id -> its entry, the number of weighted contributors)."""
        got = self._kept.get(id(contributors))
        if got is None or got[0] is not contributors:
            by_id: dict[str, Member] = {}
            for m in contributors:
                by_id.setdefault(m.worker_id, m)
            got = (contributors, by_id, sum(1 for m in contributors if m.max_samples > 0))
            kept = self._kept
            if len(kept) >= self.KEEP:
                kept.pop(next(iter(kept)), None)  # the oldest
            kept[id(contributors)] = got
        return got[1], got[2]


_CONTRIBUTORS = _Contributors()


class _Plan:
    """The actions so far, and the view as they leave it."""

    __slots__ = ("actions", "held", "sync", "work")

    def __init__(self, view: WorkerView) -> None:
        self.actions: list[Action] = []
        self.held = view.held
        self.work = view.work
        self.sync = view.sync

    def drop_work(self, why: str) -> None:
        if self.work is not None:
            self.actions.append(DropWork(why))
            self.work = None

    def cancel_sync(self) -> None:
        if self.sync is not None:
            self.actions.append(CancelSync())
            self.sync = None


def decide(i: Instruction, view: WorkerView) -> tuple[Action, ...]:
    """The actions that make what the worker does match instruction `i` (see the module
    docstring); () when it already does."""
    p = _Plan(view)
    _check_pending(i, p)
    o = i.order
    if o is Order.LEAVE:
        p.actions.append(Leave(i.reason))
        return tuple(p.actions)
    if i.upload_checkpoint:
        key = (i.cell_id, i.committed_round)
        if (
            key not in view.uploaded
            and i.committed_hash
            and holds(p.held, i.cell_id, i.committed_round, i.committed_hash)
        ):
            p.actions.append(Upload(i.cell_id, i.committed_round, i.committed_hash))
    if o is Order.WAIT:
        p.cancel_sync()
        if not _finishing(i, p.work):
            p.drop_work("ordered to wait")
    elif o is Order.SYNC:
        _on_sync(i, view, p)
    elif o is Order.TRAIN:
        _on_train(i, view, p)
    elif o is Order.REDUCE:
        _on_reduce(i, view, p)
    return tuple(p.actions)


def _check_pending(i: Instruction, p: _Plan) -> None:
    """A reported round commits when the instructions show it as the committed one."""
    w = p.work
    if w is None or w.pending_hash is None or i.cell_id != w.cell_id:
        return
    if i.committed_round == w.round and i.committed_hash == w.pending_hash:
        p.actions.append(AdoptPending())
        p.held = LocalState(w.cell_id, w.round, w.pending_hash)
        p.work = None
    elif i.committed_round >= w.round:
        p.drop_work(f"round {w.round} committed with another hash")


def _finishing(i: Instruction, w: Work | None) -> bool:
    """Is `w` the exchange of the round `i` shows just committed, still running? Its
    contributors finish it at about the same time, and the quorum is reached by the first
    reports; the coordinator holds the next round for the others' (WAIT), so such an exchange
    is finished and reported (it adopts on the verdict), not dropped."""
    return (
        w is not None
        and w.exchanging
        and w.pending_hash is None
        and w.cell_id == i.cell_id
        and w.round == i.committed_round
    )


def _on_sync(i: Instruction, view: WorkerView, p: _Plan) -> None:
    target = LocalState(i.cell_id, i.committed_round, i.committed_hash)
    if holds(p.held, i.cell_id, i.committed_round, i.committed_hash):
        p.cancel_sync()
        p.drop_work("synced")
        return
    s = p.sync
    if s is not None and s.running and s.target == target:
        return
    if (
        s is not None
        and s.running
        and view.catch_up_rounds >= 1
        and s.target.cell_id == i.cell_id
        and i.committed_round == s.target.committed_round + 1
    ):
        # the cell committed once more while we download: finish it (donors keep serving the
        # state before their newest, `StateServer.keep`), then catch up by that round's update
        # (a small fraction of the state), instead of starting the whole download again
        return
    w = p.work
    # our exchange of the round that just committed is still running (the others' reports
    # made the quorum first): its outcome is the committed state, and a late report of it is
    # taken, so let it finish; a slower member that dropped it to download the state instead
    # was one round behind again, round after round
    if (
        p.sync is None
        and w is not None
        and w.exchanging
        and w.pending_hash is None
        and (w.cell_id, w.round) == (i.cell_id, i.committed_round)
    ):
        return
    p.cancel_sync()
    p.drop_work("resync")
    p.actions.append(StartSync(i.cell_id, i.committed_round, i.committed_hash, i.donor, i.donors))


def _on_train(i: Instruction, view: WorkerView, p: _Plan) -> None:
    if p.sync is not None:
        if p.sync.target == LocalState(i.cell_id, i.committed_round, i.committed_hash):
            return  # finishing a sync; the coordinator will see our new LocalState
        # a sync of a state the coordinator no longer wants (another cell after a move, an
        # older round): finishing it first would only delay the round we are told to train
        p.cancel_sync()
    if not holds(p.held, i.cell_id, i.committed_round, i.committed_hash):
        if i.committed_round == 0 and not i.committed_hash:
            # round 0: build the initial state locally (instant), then train it
            p.actions.append(BuildInitialState(i.cell_id))
            p.held = LocalState(i.cell_id, 0, "")
        else:
            p.drop_work("told to train from a state we do not hold")
            return
    w = p.work
    if w is not None and w.matches(i.cell_id, i.round, i.round_attempt):
        return
    ids = [m.worker_id for m in i.plan.members] if i.plan is not None else []
    if view.worker_id not in ids:
        p.actions.append(NotAMember())
        return
    p.drop_work("a new round")
    index = ids.index(view.worker_id)
    p.actions.append(StartTrain(index, steps_ahead(view.ahead, i, index, p.held)))


def steps_ahead(ahead: Ahead | None, i: Instruction, member_index: int, held: LocalState | None) -> int:
    """How many of the inner steps trained ahead count toward the round `i` says to train:
    all of them when `i` is the round right after the exchange they overlapped, its base is
    that exchange's outcome and we hold it, and the plan has at least that many steps; else
    none. Data is drawn per (round, member index, members) as one sequence per member: on
    an unchanged shard the steps took the samples the plan would have had us take first.
    When the group changed, they were drawn from the member's old position in the round's
    permutation, so some of them may also be in another member's new shard, which costs
    a little diversity, not correctness (every member's update is averaged anyway);
    discarding them instead threw away most overlapped compute in a churning cell (half
    of all exchanges in `bagel-sim`'s heterogeneity-10x). `member_index` is unused and
    kept for the shells' call."""
    if ahead is None or i.plan is None or held is None:
        return 0
    plan = i.plan
    same = (
        ahead.cell_id == i.cell_id
        and i.round == ahead.base_round + 1
        and i.committed_round == ahead.base_round
        and holds(held, i.cell_id, i.committed_round, i.committed_hash)
        and ahead.steps <= plan.inner_steps
    )
    return ahead.steps if same else 0


def _on_reduce(i: Instruction, view: WorkerView, p: _Plan) -> None:
    by_id, weighted = _CONTRIBUTORS.index(i.contributors)
    me = by_id.get(view.worker_id)
    if me is None:
        return  # not ours (a stale answer): the next heartbeat corrects it
    w = p.work
    ours = w is not None and w.matches(i.cell_id, i.round, i.round_attempt)
    if me.max_samples == 0 and not (ours and w is not None and w.catch_up):
        # catch-up contributor: we hold the round's base state but trained nothing (we
        # synced during the round, or missed the freeze): exchange a zero pseudo-gradient
        # (weight 0) and apply the same outer step, so we hold the new state without a sync
        # round 0 is the initial state everyone builds, and the coordinator counts every
        # worker of the cell as holding it: build it now, or the exchange waits for a
        # contributor that never comes and the round aborts
        if p.sync is None and i.committed_round == 0 and not i.committed_hash and not holds(p.held, i.cell_id, 0, ""):
            p.actions.append(BuildInitialState(i.cell_id))
            p.held = LocalState(i.cell_id, 0, "")
        if p.sync is not None or not holds(p.held, i.cell_id, i.committed_round, i.committed_hash):
            return
        p.drop_work("catching up through the exchange")
        p.actions.append(StartCatchUp())
        w = Work(i.cell_id, i.round, i.round_attempt, ready=True, catch_up=True)
    elif not ours:
        key = (i.cell_id, i.round, i.round_attempt, i.reduce_attempt)
        h = p.held
        already = h is not None and h.cell_id == i.cell_id and h.committed_round >= i.round
        if not already and key not in view.missing_reported and p.sync is None:
            # we are a weighted contributor but lost our contribution (restart): say so,
            # so the coordinator re-freezes without us instead of waiting for its deadline
            p.actions.append(ReportMissing(*key))
        return
    assert w is not None
    if not w.ready:
        return  # still training: a freeze names us only once we are ready
    if w.pending_hash is not None and w.pending_attempt == i.reduce_attempt:
        if w.report_stale and not w.exchanging:
            p.actions.append(ReReport())  # the coordinator restarted: our report may be lost
        return
    if i.reduce_attempt <= w.reduce_attempt:
        return  # this attempt is running, done, or failed (wait for a re-freeze or abort)
    p.actions.append(StartReduce(i.reduce_attempt, weighted))


def decide_verdict(verdict: Verdict | None, *, reported_outcome: bool, current: bool) -> tuple[Action, ...]:
    """What the answer to a ReportRound means for the work that reported. `reported_outcome`:
    the report carried an outcome (not a failed exchange); `current`: that work is still
    the worker's current work. COMMITTED adopts the outcome; PENDING waits until an
    instruction shows our hash committed (or another one: `decide` drops it then);
    RESYNC and ABORTED drop the work (the committed state was never touched)."""
    if verdict is Verdict.COMMITTED and reported_outcome and current:
        return (AdoptPending(),)
    if verdict in (Verdict.RESYNC, Verdict.ABORTED) and current:
        return (DropWork(f"VERDICT_{verdict.name}"),)
    return ()


__all__ = [
    "Action",
    "AdoptPending",
    "Ahead",
    "BuildInitialState",
    "CancelSync",
    "DropWork",
    "Leave",
    "NotAMember",
    "ReReport",
    "ReportMissing",
    "StartCatchUp",
    "StartReduce",
    "StartSync",
    "StartTrain",
    "Sync",
    "Upload",
    "Work",
    "WorkerView",
    "decide",
    "decide_verdict",
    "holds",
    "steps_ahead",
]

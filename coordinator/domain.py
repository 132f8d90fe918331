"""Domain types of the coordinator core: wire mirrors, events, durable records, outcomes.

The pure core (`state.py`, `scheduler.py`) speaks only these types; the gRPC shell
translates protobuf <-> domain and the simulator builds the events directly, so both drive
one and the same state machine. Enum numbers equal the proto's (`protocol/bagel.proto`),
so translation is `Order(pb.order)` / `pb_order = int(order)`.

Three families:
- *wire mirrors* (`Profile`, `LocalState`, `Instruction`, ...): what a message carries;
- *events* (`Register`, `Heartbeat`, ...): the inputs of `CoordinatorState.apply(now_ms, event)`;
- *records* (`WorkerRecord`, `CellRecord`, `RoundRecord`, `CommitRecord`): the durable rows
  a transition changed, returned in `Outcome.effects` for the shell to write to SQLite in one
  transaction before it answers, and fed back to `CoordinatorState.restore` after a restart.

Everything is a frozen dataclass; mapping-valued fields hold plain dicts that must be
treated as read-only (the core never mutates a dict it has put in a record).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

# ---------------------------------------------------------------- enums (proto numbers)


class Phase(enum.IntEnum):
    """What a worker says it is doing (proto `Phase`)."""

    UNSPECIFIED = 0
    IDLE = 1  # waiting for an instruction
    SYNCING = 2  # downloading state
    TRAINING = 3  # inner steps of `round`
    READY = 4  # finished training `round`; a contribution of `samples` is ready
    REDUCING = 5  # exchanging parts with the contributors


class Order(enum.IntEnum):
    """What the coordinator tells a worker to do (proto `Order`)."""

    UNSPECIFIED = 0
    WAIT = 1  # nothing for you now: keep heartbeating
    SYNC = 2  # fetch the cell's committed state from `donor` (or the checkpoint)
    TRAIN = 3  # train `round` per `plan`, then heartbeat READY
    REDUCE = 4  # contributors are frozen: average with exactly `contributors`
    LEAVE = 5  # banned or the run is over: exit


class Verdict(enum.IntEnum):
    """Answer to a ReportRound (proto `Verdict`)."""

    UNSPECIFIED = 0
    PENDING = 1  # counted; waiting for the quorum
    COMMITTED = 2  # the round is committed with your hash
    RESYNC = 3  # your hash disagrees with the committed one: resync
    ABORTED = 4  # the round was aborted: roll back to the last committed state


class RoundState(enum.Enum):
    """Lifecycle of one attempt of one outer round of one cell.

    OPEN -> TRAINING -> REDUCING -> COMMITTED | ABORTED; OPEN and TRAINING may also go
    straight to ABORTED (deadline without a quorum, every member lost).
    """

    OPEN = "open"  # members told to train; nobody has said it started
    TRAINING = "training"  # at least one member trains (or is ready)
    REDUCING = "reducing"  # contributors frozen; waiting for a quorum of equal hashes
    COMMITTED = "committed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in (RoundState.COMMITTED, RoundState.ABORTED)


class WorkerState(enum.Enum):
    """Status of a worker record (proto `WorkerStatus.state` strings)."""

    ACTIVE = "active"
    LOST = "lost"  # lease expired; re-registers to come back
    LEFT = "left"  # sent Leave
    BANNED = "banned"  # reputation fell past schedule.ban_reputation; final


# ---------------------------------------------------------------- wire mirrors


@dataclass(frozen=True, slots=True)
class PeerAddress:
    peer_id: str = ""
    maddrs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Profile:
    """A worker's measured profile (proto `WorkerProfile`)."""

    name: str = ""
    device_kind: str = "cpu"
    device_name: str = ""
    vram_bytes: int = 0
    num_devices: int = 1
    link_bandwidth_bytes_per_s: float = 0.0  # 0 = unknown (Policy.default_bandwidth is used)
    samples_per_s: Mapping[str, float] = field(default_factory=dict)  # by cell id
    software_version: str = ""


@dataclass(frozen=True, slots=True)
class LocalState:
    """The committed state a worker holds locally (proto `LocalState`)."""

    cell_id: str = ""  # "" = nothing
    committed_round: int = 0
    state_hash: str = ""


@dataclass(frozen=True, slots=True)
class Member:
    """A round member as the wire shows it (proto `Member`)."""

    worker_id: str
    peer: PeerAddress
    max_samples: int  # cap on this member's averaging weight in the round


@dataclass(frozen=True, slots=True)
class MemberPlan:
    """One member's share of a round: its batch shape and sample budget (core-only)."""

    worker_id: str
    peer: PeerAddress
    micro_batch: int
    grad_accum: int
    max_samples: int  # = micro_batch * grad_accum * inner_steps

    def member(self) -> Member:
        return Member(self.worker_id, self.peer, self.max_samples)


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """The plan as one worker receives it (proto `RoundPlan`): its own batch shape."""

    inner_steps: int
    micro_batch: int
    grad_accum: int
    deadline_unix_ms: int
    members: tuple[Member, ...]  # sorted by worker_id; data shard index = position


@dataclass(frozen=True, slots=True)
class Donor:
    """Where to fetch state from (proto `Donor`); worker_id "" = the coordinator checkpoint."""

    worker_id: str = ""
    peer: PeerAddress = PeerAddress()
    checkpoint_round: int = -1  # latest checkpoint held for the cell (-1 = none)


@dataclass(frozen=True, slots=True)
class Instruction:
    """The level-triggered order for one worker (proto `Instruction`)."""

    order: Order
    cell_id: str = ""
    round: int = 0  # round to train/reduce (= committed_round + 1)
    committed_round: int = 0
    committed_hash: str = ""
    plan: RoundPlan | None = None  # TRAIN and REDUCE
    contributors: tuple[Member, ...] = ()  # REDUCE, sorted by worker_id
    donor: Donor | None = None  # SYNC
    upload_checkpoint: bool = False  # stream the committed state to UploadCheckpoint
    reason: str = ""
    reduce_attempt: int = 0  # REDUCE: bumps whenever a contributor set is (re-)frozen
    round_attempt: int = 0  # TRAIN/REDUCE: bumps when an aborted round is re-run


# ---------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Register:
    worker_id: str
    profile: Profile
    peer: PeerAddress = PeerAddress()
    local: LocalState = LocalState()


@dataclass(frozen=True, slots=True)
class Heartbeat:
    worker_id: str
    phase: Phase
    cell_id: str = ""
    round: int = 0
    inner_step: int = 0
    loss: float = 0.0
    samples: int = 0  # PHASE_READY: samples processed this round
    local: LocalState = LocalState()
    reduce_attempt: int = 0  # PHASE_REDUCING: the attempt being exchanged
    # which run of `round` this phase is about (Instruction.round_attempt); 0 = not given,
    # in which case a READY is taken to be about the current attempt.
    round_attempt: int = 0


@dataclass(frozen=True, slots=True)
class ReportRound:
    worker_id: str
    cell_id: str
    round: int
    state_hash: str = ""
    samples: int = 0
    loss: float = 0.0
    compute_ms: int = 0
    comm_ms: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    failed: bool = False  # the exchange failed; `reason` says why (no hash)
    reason: str = ""
    reduce_attempt: int = 0


@dataclass(frozen=True, slots=True)
class Leave:
    worker_id: str
    reason: str = ""
    # the worker can upload its committed state first: if it is the last live holder of a
    # round the coordinator has no checkpoint of, the Leave answers with an upload order
    # instead of leaving (a graceful leave then loses no committed round)
    offer_checkpoint: bool = False


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: expire leases, fire round and reduce deadlines."""


@dataclass(frozen=True, slots=True)
class LeaseExpired:
    """Declare a worker's lease expired now, as Tick would when its lease runs out.

    The daemon never sends it (Tick finds expired leases itself). The simulator, which
    knows when a virtual worker dies, sends it at death + lease_s instead of delivering
    one lease-renewing heartbeat per worker per lease period.
    """

    worker_id: str


@dataclass(frozen=True, slots=True)
class CheckpointStored:
    """The shell verified and stored an uploaded checkpoint of a committed round."""

    cell_id: str
    round: int
    state_hash: str


Event: TypeAlias = Register | Heartbeat | ReportRound | Leave | Tick | LeaseExpired | CheckpointStored


# ---------------------------------------------------------------- durable records


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One worker row. Leases, phase and loss are volatile and not part of it."""

    worker_id: str
    profile: Profile
    peer: PeerAddress
    state: WorkerState
    cell_id: str  # "" = unassigned
    local: LocalState  # committed state the worker holds (as last reported or committed)
    reputation: float
    throughput: Mapping[str, float]  # EMA of samples/s by cell id (SWARM PerformanceEMA)
    rounds_contributed: int
    registered_ms: int
    reason: str = ""  # why LOST/LEFT/BANNED


@dataclass(frozen=True, slots=True)
class CellRecord:
    cell_id: str
    committed_round: int = 0
    committed_hash: str = ""  # "" = the deterministic initial state (round 0)
    samples_committed: int = 0
    last_loss: float = 0.0
    checkpoint_round: int = -1  # latest stored checkpoint (-1 = none)
    checkpoint_hash: str = ""
    upload_round: int = -1  # committed round whose checkpoint is requested (-1 = none)
    uploader: str = ""  # worker asked to upload it
    # the next round number's history, so a re-run never reuses an id:
    round_attempt: int = 0  # attempts of round committed_round + 1 started so far
    reduce_attempt: int = 0  # contributor sets of round committed_round + 1 frozen so far
    rollbacks: int = 0  # times the cell fell back to its checkpoint (orphaned)


@dataclass(frozen=True, slots=True)
class ReportEntry:
    state_hash: str
    failed: bool
    samples: int
    reduce_attempt: int
    loss: float = 0.0


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """One attempt of one round of one cell; key (cell_id, round, attempt)."""

    cell_id: str
    round: int
    attempt: int  # 1 for the first run of `round`, +1 per re-run after an abort
    state: RoundState
    opened_ms: int
    deadline_ms: int
    inner_steps: int
    members: tuple[MemberPlan, ...]  # sorted by worker_id
    dropped: tuple[str, ...] = ()  # members lost/left/moved during the round, sorted
    # member -> samples it said READY with; recorded from the freeze on (before it,
    # readiness is volatile: ready workers keep heartbeating READY after a restart)
    ready: Mapping[str, int] = field(default_factory=dict)
    contributors: tuple[str, ...] = ()  # frozen at REDUCING, sorted (catch_up included)
    # contributors with zero weight: workers holding the round's base state that did not
    # train it (joiners, members not ready at the freeze). They exchange a zero
    # pseudo-gradient and apply the same outer step, so they end up holding the new state.
    catch_up: tuple[str, ...] = ()
    reduce_attempt: int = 0  # of the frozen contributor set (0 before the freeze)
    first_reduce_attempt: int = 0  # this attempt's first freeze (older ones were aborted runs)
    frozen_ms: int = 0
    reduce_deadline_ms: int = 0
    reports: Mapping[str, ReportEntry] = field(default_factory=dict)
    predicted_compute_ms: int = 0
    predicted_comm_ms: int = 0
    ended_ms: int = 0
    reason: str = ""  # why it ended (abort cause)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.cell_id, self.round, self.attempt)


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """Append-only: round `round` of `cell_id` is committed with `state_hash`.

    `contributors` and `agreeing` include zero-weight catch-up contributors; the quorum
    was counted over the weighted ones (RoundRecord.contributors minus catch_up).
    """

    cell_id: str
    round: int
    attempt: int
    state_hash: str
    committed_ms: int
    contributors: tuple[str, ...]
    agreeing: tuple[str, ...]  # contributors that reported state_hash
    samples: int  # sum of min(samples, max_samples) over the agreeing contributors
    loss: float  # mean reported loss of the agreeing contributors


Record: TypeAlias = WorkerRecord | CellRecord | RoundRecord | CommitRecord


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every current record of a state (`CoordinatorState.snapshot()`), sorted by key.

    `rounds` holds the open (non-terminal) round of each cell; `commits` the recent
    commits the core keeps (enough to verify checkpoint uploads).
    """

    workers: tuple[WorkerRecord, ...]
    cells: tuple[CellRecord, ...]
    rounds: tuple[RoundRecord, ...]
    commits: tuple[CommitRecord, ...]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a transition produced.

    - `instruction`: for the calling worker (Register, Heartbeat, ReportRound), else None;
    - `verdict`: ReportRound only;
    - `lease_expires_ms`: the caller's renewed lease;
    - `effects`: the durable records this transition changed (full rows, upsert by key;
      CommitRecords are appended). Write them in one transaction before answering.
      A heartbeat that changes nothing has no effects.
    """

    instruction: Instruction | None = None
    verdict: Verdict | None = None
    lease_expires_ms: int | None = None
    effects: tuple[Record, ...] = ()


@dataclass(frozen=True, slots=True)
class CellConfig:
    """What the shell computes per cell, once, from the spec and the models.

    memory_bytes: params + grads + optimizer + outer state + one micro-batch (VRAM fit);
    target_share: the cell's share of total compute (normalised by the core);
    payload_bytes: bytes of one encoded pseudo-gradient (for the communication estimate).
    """

    cell_id: str
    memory_bytes: int
    target_share: float = 1.0
    payload_bytes: int = 0  # 0 = unknown: memory_bytes // 16 is used

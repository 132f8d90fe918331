"""Durable records of the coordinator core, and the per-cell configuration it is built with.

A transition returns the records it changed in `Outcome.effects`; the shell writes them to
SQLite in one transaction before it answers, and feeds them back to
`CoordinatorState.restore` after a restart. Every record is a frozen dataclass; its
mapping-valued fields hold plain dicts that must be treated as read-only.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

from bagel.protocol.fastinit import fast_init
from bagel.protocol.messages import LocalState, Member, PeerAddress, Profile


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


@fast_init
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


@fast_init
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


@fast_init
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
    # the commit guard's reference: median held-out loss of the committed state (-1 = unknown)
    heldout_loss: float = -1.0
    guard_refusals: int = 0  # attempts the commit guard refused, over the cell's life


@fast_init
@dataclass(frozen=True, slots=True)
class ReportEntry:
    state_hash: str
    failed: bool
    samples: int
    reduce_attempt: int
    loss: float = 0.0
    heldout_loss: float = -1.0  # the commit guard's measurements (-1 = not reported)
    heldout_loss_base: float = -1.0


@fast_init
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
    # members admitted while the round trained (`Rounds.admit_late`), in the order they came
    # (their data shards follow from that order, `RoundPlan.shard_members`)
    late: tuple[MemberPlan, ...] = ()
    # when the round freezes with the members ready by then, not waiting for the last few
    # (`Rounds.check_freeze`); 0 = not set
    freeze_by_ms: int = 0
    # the split of the frozen exchange, kept with its contributors so a restarted coordinator
    # answers the same REDUCE: who reduces no part (relayed), and each part weight that is
    # not 1 (`scheduler.part_weights`)
    no_reduce: tuple[str, ...] = ()
    part_weights: Mapping[str, int] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.cell_id, self.round, self.attempt)


@fast_init
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
    heldout_loss: float = -1.0  # median held-out loss the agreeing reports gave (-1 = none)


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
class CellConfig:
    """What the shell computes per cell, once, from the spec and the models.

    memory_bytes: what training holds on the device (weights, gradients, AdamW's moments)
    with the activations of one sample (of the run's largest micro-batch where
    `sample_bytes` is 0): what must fit the VRAM;
    target_share: the cell's share of total compute (normalised by the core);
    payload_bytes: bytes of one encoded pseudo-gradient (for the communication estimate);
    sample_bytes: activation memory per sample of a micro-batch. With it, each member's
    micro-batch is as large as its own memory allows (`protocol.cellmemory.micro_batch_cap`), so a
    card that fits the cell at a small micro-batch trains it with more accumulation; 0
    (configs stored before it existed, the simulator's) sizes every member at the run's
    `diloco.max_micro_batch`;
    host_bytes: what a worker holds on the host besides (committed states, the exchange's
    working copies): what must fit a GPU worker's RAM, and adds to a CPU worker's device
    share; 0 (configs stored before it existed, the simulator's) is not checked.
    The rule is `bagel.protocol.cellmemory.fits`.
    """

    cell_id: str
    memory_bytes: int
    target_share: float = 1.0
    payload_bytes: int = 0  # 0 = unknown: memory_bytes // 16 is used
    sample_bytes: int = 0
    host_bytes: int = 0

"""Events: the inputs of `CoordinatorState.apply(now_ms, event)`, and the `Outcome` it returns.

The gRPC shell builds them from verified requests; the simulator builds them directly, so
both drive one and the same state machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from bagel.coordinator.core.records import Record
from bagel.protocol.fastinit import fast_init
from bagel.protocol.messages import (
    DonorRate,
    Instruction,
    LocalState,
    PartAudit,
    PeerAddress,
    PeerRates,
    Phase,
    Profile,
    Verdict,
)


@fast_init
@dataclass(frozen=True, slots=True)
class Register:
    worker_id: str
    profile: Profile
    peer: PeerAddress = PeerAddress()
    local: LocalState = LocalState()


@fast_init
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
    # what the worker measured of the donors of its last verified sync (read while the
    # coordinator still counts those donors as serving it)
    donor_rates: tuple[DonorRate, ...] = ()


@fast_init
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
    audit: PartAudit | None = None  # what the reporter saw of the part it reduced
    # the commit guard: held-out loss of the new state and of the round's base state on the
    # cell's guard batch (None: not measured)
    heldout_loss: float | None = None
    heldout_loss_base: float | None = None
    # what the reporter measured of each peer's contribution to the part it reduced
    # (`Roster.observe_peer_rates`: the others' measures of a member make its uplink estimate)
    peer_rates: PeerRates = PeerRates()


@fast_init
@dataclass(frozen=True, slots=True)
class Leave:
    worker_id: str
    reason: str = ""
    # the worker can upload its committed state first: if it is the last live holder of a
    # round the coordinator has no checkpoint of, the Leave answers with an upload order
    # instead of leaving (a graceful leave then loses no committed round)
    offer_checkpoint: bool = False


@fast_init
@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: expire leases, fire round and reduce deadlines."""


@fast_init
@dataclass(frozen=True, slots=True)
class LeaseExpired:
    """Declare a worker's lease expired now, as Tick would when its lease runs out.

    The daemon never sends it (Tick finds expired leases itself). The simulator, which
    knows when a virtual worker dies, sends it at death + lease_s instead of delivering
    one lease-renewing heartbeat per worker per lease period.
    """

    worker_id: str


@fast_init
@dataclass(frozen=True, slots=True)
class CheckpointStored:
    """The shell verified and stored an uploaded checkpoint of a committed round."""

    cell_id: str
    round: int
    state_hash: str


@dataclass(frozen=True, slots=True)
class Convicted:
    """The shell verified evidence that `worker_id` lied in the exchange it names.

    Built only after `bagel.robust.evidence.adjudicate` re-ran the disputed reduction (or
    found two signed contributions of one sender to one part): the worker is banned with
    `reason`, and if that exchange is still the cell's open one it is discarded (re-frozen
    without the worker, or aborted), so the round never commits with its bytes.
    """

    worker_id: str
    accuser: str
    cell_id: str
    round: int
    round_attempt: int
    reduce_attempt: int
    reason: str


Event: TypeAlias = Register | Heartbeat | ReportRound | Leave | Tick | LeaseExpired | CheckpointStored | Convicted


@fast_init
@dataclass(frozen=True, slots=True)
class Outcome:
    """What a transition produced.

    - `instruction`: for the calling worker (Register, Heartbeat, ReportRound), else None;
    - `verdict`: ReportRound only;
    - `lease_expires_ms`: the caller's renewed lease;
    - `effects`: the durable records this transition changed (full rows, upsert by key;
      CommitRecords are appended). Write them in one transaction before answering.
      A heartbeat that changes nothing has no effects. A core built with
      `records=False` (the simulator's) hands back the changed live entities instead of
      their records, and the commit records as they are.
    """

    instruction: Instruction | None = None
    verdict: Verdict | None = None
    lease_expires_ms: int | None = None
    effects: tuple[Record, ...] = ()

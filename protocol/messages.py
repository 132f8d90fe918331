"""What coordinator-worker messages carry, as plain frozen dataclasses (the wire mirrors).

The coordinator core, the worker's reconciler and the simulator speak these types; the gRPC
shells translate protobuf <-> these at their edges. Enum numbers equal the proto's
(`protocol/bagel.proto`), so translation is `Order(pb.order)` / `pb_order = int(order)`.
Mapping-valued fields hold plain dicts that must be treated as read-only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from bagel.protocol.fastinit import fast_init


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
    SYNC = 2  # fetch the cell's committed state from `donors` / `donor` (or the checkpoint)
    TRAIN = 3  # train `round` per `plan`, then heartbeat READY
    REDUCE = 4  # contributors are frozen: average with exactly `contributors`
    LEAVE = 5  # banned or the run is over: exit


class Reachability(enum.IntEnum):
    """How a worker's peers reach it (proto `PeerReachability`)."""

    UNKNOWN = 0  # not reported (an older worker)
    DIRECT = 1  # at its own, publicly routable address
    RELAYED = 2  # behind a NAT, through a libp2p circuit relay
    UNREACHABLE = 3  # behind a NAT and no relay: it can dial out, nobody can dial in


class Verdict(enum.IntEnum):
    """Answer to a ReportRound (proto `Verdict`)."""

    UNSPECIFIED = 0
    PENDING = 1  # counted; waiting for the quorum
    COMMITTED = 2  # the round is committed with your hash
    RESYNC = 3  # your hash disagrees with the committed one: resync
    ABORTED = 4  # the round was aborted: roll back to the last committed state


@fast_init
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
    reachability: Reachability = Reachability.UNKNOWN
    reachability_detail: str = ""
    host_memory_bytes: int = 0  # RAM beside a separate device (0: not declared)


@fast_init
@dataclass(frozen=True, slots=True)
class LocalState:
    """The committed state a worker holds locally (proto `LocalState`)."""

    cell_id: str = ""  # "" = nothing
    committed_round: int = 0
    state_hash: str = ""


@fast_init
@dataclass(frozen=True, slots=True)
class Member:
    """A round member as the wire shows it (proto `Member`)."""

    worker_id: str
    peer: PeerAddress
    max_samples: int  # cap on this member's averaging weight in the round
    no_reduce: bool = False  # reduces no part (reached through a relay): an empty part in the split
    # its part's relative size in the split (`bagel.robust.reduction.part_bounds`), from the
    # uplink the other members measured of it; 1 for every member = equal parts
    part_weight: int = 1


# One contributor of a frozen exchange as its group digest binds it (`robust.reduction.
# group_digest_of`): (worker id, peer id, budget[, no_reduce[, part weight]]), the optional
# fields only when they are set, so a set of plain members hashes as it always did.
FrozenMember = tuple[str, str, int] | tuple[str, str, int, bool] | tuple[str, str, int, bool, int]


def frozen_member(worker_id: str, peer_id: str, budget: int, no_reduce: bool, part_weight: int) -> FrozenMember:
    """The `FrozenMember` of one contributor; the coordinator (its frozen sets, what evidence
    is checked against) and every member's data plane write it with this one function."""
    if part_weight != 1:
        return (worker_id, peer_id, budget, no_reduce, part_weight)
    if no_reduce:
        return (worker_id, peer_id, budget, True)
    return (worker_id, peer_id, budget)


@fast_init
@dataclass(frozen=True, slots=True)
class RoundPlan:
    """The plan as one worker receives it (proto `RoundPlan`): its own batch shape."""

    inner_steps: int
    micro_batch: int
    grad_accum: int
    deadline_unix_ms: int
    # the members the round opened with, sorted by worker_id, then (from `late_from` on)
    # the late joiners admitted while it trained, in the order they came; data shard index
    # = position
    members: tuple[Member, ...]
    late_from: int = 0  # position of the first late joiner (0 = none)

    def shard_members(self, index: int) -> int:
        """The group size member `index` draws its data shard with (`models.data.shard`):
        the opening members' count for them, and for a late joiner its position + 1, so it
        owns the next stride of the round's permutation and no opening member's data moves."""
        if 0 < self.late_from <= index:
            return index + 1
        return self.late_from if self.late_from > 0 else len(self.members)


@fast_init
@dataclass(frozen=True, slots=True)
class Donor:
    """Where to fetch state from (proto `Donor`); worker_id "" = the coordinator checkpoint."""

    worker_id: str = ""
    peer: PeerAddress = PeerAddress()
    checkpoint_round: int = -1  # latest checkpoint held for the cell (-1 = none)
    expected_bytes_per_s: float = 0.0  # what this donor is expected to give the joiner (0 = unknown)


@fast_init
@dataclass(frozen=True, slots=True)
class DonorRate:
    """What a joiner measured of one donor of its last verified sync (proto `DonorRate`):
    the verified bytes it adopted from that donor, and the time the donor's requests were
    in flight. The coordinator's measure of the donor's uplink comes from these."""

    worker_id: str
    nbytes: int
    ms: int


class PeerRate(NamedTuple):
    """What a contributor measured, as a reducer, of one peer's contribution to its part in
    an exchange (proto `PeerRate`): the payload's bytes and the time they took to arrive.
    The coordinator's estimate of the peer's uplink comes from what the others measured.
    The (sender, bytes, ms) triple the data plane measures (`ExchangeResult.peer_rates`);
    a report carries them column-wise (`PeerRates`)."""

    worker_id: str
    nbytes: int
    ms: int


@fast_init
@dataclass(frozen=True, slots=True)
class PeerRates:
    """The `PeerRate`s of one report, column by column: entry i is (worker_ids[i],
    nbytes[i], ms[i]). Columns, not a tuple of entries: an exchange of k contributors makes
    k x (k - 1) of them, which the coordinator checks and reads a column at a time in C
    (`CoordinatorState`'s check, `Roster.observe_peer_rates`). Iterating gives the entries."""

    worker_ids: tuple[str, ...] = ()
    nbytes: tuple[int, ...] = ()
    ms: tuple[int, ...] = ()

    @classmethod
    def of(cls, entries: Iterable[tuple[str, int, int]]) -> PeerRates:
        """The columns of (worker id, bytes, ms) entries."""
        rows = tuple(entries)
        return cls(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows))

    def __len__(self) -> int:
        return len(self.worker_ids)

    def __iter__(self) -> Iterator[PeerRate]:
        return map(PeerRate, self.worker_ids, self.nbytes, self.ms)


@fast_init
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
    donors: tuple[Donor, ...] = ()  # SYNC: every donor to fetch ranges from, best first (donors[0] is `donor`)
    upload_checkpoint: bool = False  # stream the committed state to UploadCheckpoint
    reason: str = ""
    reduce_attempt: int = 0  # REDUCE: bumps whenever a contributor set is (re-)frozen
    round_attempt: int = 0  # TRAIN/REDUCE: bumps when an aborted round is re-run
    reduce_deadline_unix_ms: int = 0  # REDUCE: when the coordinator gives up on the exchange (0: not said)


@dataclass(frozen=True, slots=True)
class SenderAudit:
    """One sender's contribution to a part, as the part's reducer saw it (proto `AuditSender`)."""

    sender: str
    norm: float = 0.0  # L2 norm of the decoded contribution (0 when excluded)
    max_cosine: float = 0.0  # the highest cosine with another sender's contribution to the part
    nearest: str = ""  # that other sender
    excluded: str = ""  # non-empty: the reducer left it out, and why
    sketch: tuple[int, ...] = ()  # 64 sign bits per sketch block lying wholly inside the part
    # the loss audit (worker/heldout.py `SliceLossAudit`): loss of the committed state minus the
    # loss with this sender's slice applied, on its assigned samples and on a random batch
    loss_gain: float = 0.0
    loss_gain_random: float = 0.0
    loss_measured: bool = False


@dataclass(frozen=True, slots=True)
class PartAudit:
    """What a contributor saw of the part it reduced (proto `AuditPart`)."""

    part: int  # the reporter's index among the sorted contributors
    first_block: int = 0  # the sketch block of every sender's sketch[0]
    senders: tuple[SenderAudit, ...] = ()

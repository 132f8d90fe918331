"""Protobuf <-> `bagel.protocol.messages`, for the messages both sides of the wire read.

The coordinator's gRPC shell (`coordinator/translate.py`) turns requests into core events
and instructions into responses; the worker turns the instructions it receives into the
domain `Instruction` its reconciler reads (`worker/reconciler.py`). Both use these pure
functions, so the two directions of each message live in one place. Enum numbers are
shared by the proto and the domain, so enums translate by value; a number this side
does not know becomes UNSPECIFIED.
"""

from __future__ import annotations

import hashlib
import math

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.messages import (
    Donor,
    Instruction,
    LocalState,
    Member,
    Order,
    PartAudit,
    PeerAddress,
    Profile,
    Reachability,
    RoundPlan,
    SenderAudit,
    Verdict,
)
from bagel.protocol.runspec import MAX_SYNC_DONORS

# ---------------------------------------------------------------- proto -> domain

_REACHABILITIES = frozenset(int(r) for r in Reachability)


def peer_from_pb(p: pb.PeerAddress) -> PeerAddress:
    return PeerAddress(peer_id=p.peer_id, maddrs=tuple(p.maddrs))


def profile_from_pb(p: pb.WorkerProfile) -> Profile:
    return Profile(
        name=p.name,
        device_kind=p.device_kind,
        device_name=p.device_name,
        vram_bytes=p.vram_bytes,
        num_devices=p.num_devices,
        link_bandwidth_bytes_per_s=p.link_bandwidth_bytes_per_s,
        samples_per_s=dict(sorted(p.samples_per_s.items())),
        software_version=p.software_version,
        reachability=Reachability(p.reachability) if p.reachability in _REACHABILITIES else Reachability.UNKNOWN,
        reachability_detail=p.reachability_detail,
        host_memory_bytes=p.host_memory_bytes,
    )


def local_from_pb(p: pb.LocalState) -> LocalState:
    return LocalState(cell_id=p.cell_id, committed_round=p.committed_round, state_hash=p.state_hash)


MAX_PART_WEIGHT = 1 << 16  # far above any weight the core gives (it stays within 16x the median)


def part_weight_from_wire(v: int) -> int:
    """A part weight as every worker reads it: 0 (unset) is 1, and it stays within
    [1, MAX_PART_WEIGHT], so members and the coordinator bind the same weights."""
    return min(MAX_PART_WEIGHT, max(1, int(v)))


def member_from_pb(m: pb.Member) -> Member:
    """A member as the worker reads it; a part weight outside [1, MAX_PART_WEIGHT] (0: unset,
    equal parts) is clamped into it, so the split stays small integer arithmetic."""
    return Member(
        worker_id=m.worker_id,
        peer=peer_from_pb(m.peer),
        max_samples=m.max_samples,
        no_reduce=m.no_reduce,
        part_weight=part_weight_from_wire(m.part_weight),
    )


def donor_from_pb(d: pb.Donor) -> Donor:
    bw = d.expected_bytes_per_s
    return Donor(
        worker_id=d.worker_id,
        peer=peer_from_pb(d.peer),
        checkpoint_round=d.checkpoint_round,
        expected_bytes_per_s=bw if math.isfinite(bw) and bw > 0 else 0.0,  # a bad figure reads as unknown
    )


def donor_to_pb(d: Donor) -> pb.Donor:
    return pb.Donor(
        worker_id=d.worker_id,
        peer=peer_to_pb(d.peer),
        checkpoint_round=d.checkpoint_round,
        expected_bytes_per_s=d.expected_bytes_per_s,
    )


def instruction_from_pb(p: pb.Instruction) -> Instruction:
    """The inverse of `instruction_to_pb`: absent plan and donor messages become None."""
    plan = None
    if p.HasField("plan"):
        q = p.plan
        # a late joiner's position must name one of the members; anything else reads as none
        late = q.late_from if 0 < q.late_from < len(q.members) else 0
        plan = RoundPlan(
            inner_steps=q.inner_steps,
            micro_batch=q.micro_batch,
            grad_accum=q.grad_accum,
            deadline_unix_ms=q.deadline_unix_ms,
            members=tuple(member_from_pb(m) for m in q.members),
            late_from=late,
        )
    donor = donor_from_pb(p.donor) if p.HasField("donor") else None
    return Instruction(
        order=order_from_pb(p.order),
        cell_id=p.cell_id,
        round=p.round,
        committed_round=p.committed_round,
        committed_hash=p.committed_hash,
        plan=plan,
        contributors=tuple(member_from_pb(m) for m in p.contributors),
        donor=donor,
        donors=tuple(donor_from_pb(d) for d in p.donors[:MAX_SYNC_DONORS]),  # more are not read
        upload_checkpoint=p.upload_checkpoint,
        reason=p.reason,
        reduce_attempt=p.reduce_attempt,
        round_attempt=p.round_attempt,
        reduce_deadline_unix_ms=p.reduce_deadline_unix_ms,
    )


def audit_from_pb(p: pb.AuditPart) -> PartAudit:
    return PartAudit(
        p.part,
        p.first_block,
        tuple(
            SenderAudit(
                s.sender,
                s.norm,
                s.max_cosine,
                s.nearest,
                s.excluded,
                tuple(s.sketch),
                loss_gain=s.loss_gain,
                loss_gain_random=s.loss_gain_random,
                loss_measured=s.loss_measured,
            )
            for s in p.senders
        ),
    )


def order_from_pb(o: int) -> Order:
    return Order(o) if o in _ORDERS else Order.UNSPECIFIED


def verdict_from_pb(v: int) -> Verdict:
    return Verdict(v) if v in _VERDICTS else Verdict.UNSPECIFIED


_ORDERS = frozenset(int(o) for o in Order)
_VERDICTS = frozenset(int(v) for v in Verdict)


# ---------------------------------------------------------------- domain -> proto


def peer_to_pb(p: PeerAddress) -> pb.PeerAddress:
    return pb.PeerAddress(peer_id=p.peer_id, maddrs=p.maddrs)


def local_to_pb(s: LocalState) -> pb.LocalState:
    return pb.LocalState(cell_id=s.cell_id, committed_round=s.committed_round, state_hash=s.state_hash)


def member_to_pb(m: Member) -> pb.Member:
    return pb.Member(
        worker_id=m.worker_id,
        peer=peer_to_pb(m.peer),
        max_samples=m.max_samples,
        no_reduce=m.no_reduce,
        part_weight=m.part_weight if m.part_weight != 1 else 0,  # unset = 1: the wire of equal parts is unchanged
    )


def instruction_tag(msg: pb.Instruction) -> int:
    """64 bits of a BLAKE2b hash of the instruction's deterministic serialization, its own
    `tag` field left out: the same instruction, the same tag (within one protobuf
    runtime, which is all a long poll compares: the coordinator made both tags)."""
    body = msg
    if msg.tag:
        body = pb.Instruction()
        body.CopyFrom(msg)
        body.ClearField("tag")
    digest = hashlib.blake2b(body.SerializeToString(deterministic=True), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def instruction_to_pb(ins: Instruction | None) -> pb.Instruction:
    """The wire form of `ins` (None: a bare WAIT), with its `tag` set (`instruction_tag`)."""
    out = _instruction_body(ins)
    out.tag = instruction_tag(out)
    return out


def _instruction_body(ins: Instruction | None) -> pb.Instruction:
    if ins is None:
        return pb.Instruction(order=pb.ORDER_WAIT)
    out = pb.Instruction(
        order=int(ins.order),  # type: ignore[arg-type]
        cell_id=ins.cell_id,
        round=ins.round,
        committed_round=ins.committed_round,
        committed_hash=ins.committed_hash,
        upload_checkpoint=ins.upload_checkpoint,
        reason=ins.reason,
        reduce_attempt=ins.reduce_attempt,
        round_attempt=ins.round_attempt,
        reduce_deadline_unix_ms=ins.reduce_deadline_unix_ms,
    )
    if ins.plan is not None:
        p = ins.plan
        out.plan.CopyFrom(
            pb.RoundPlan(
                inner_steps=p.inner_steps,
                micro_batch=p.micro_batch,
                grad_accum=p.grad_accum,
                deadline_unix_ms=p.deadline_unix_ms,
                members=[member_to_pb(m) for m in p.members],
                late_from=p.late_from,
            )
        )
    if ins.contributors:
        out.contributors.extend(member_to_pb(m) for m in ins.contributors)
    if ins.donor is not None:
        out.donor.CopyFrom(donor_to_pb(ins.donor))
    out.donors.extend(donor_to_pb(d) for d in ins.donors)
    return out


def audit_to_pb(a: PartAudit) -> pb.AuditPart:
    return pb.AuditPart(
        part=a.part,
        first_block=a.first_block,
        senders=[
            pb.AuditSender(
                sender=s.sender,
                norm=s.norm,
                max_cosine=s.max_cosine,
                nearest=s.nearest,
                excluded=s.excluded,
                sketch=list(s.sketch),
                loss_gain=s.loss_gain,
                loss_gain_random=s.loss_gain_random,
                loss_measured=s.loss_measured,
            )
            for s in a.senders
        ],
    )


VERDICTS = {
    Verdict.PENDING: pb.VERDICT_PENDING,
    Verdict.COMMITTED: pb.VERDICT_COMMITTED,
    Verdict.RESYNC: pb.VERDICT_RESYNC,
    Verdict.ABORTED: pb.VERDICT_ABORTED,
}


def verdict_to_pb(v: Verdict | None) -> int:
    return VERDICTS.get(v, pb.VERDICT_UNSPECIFIED) if v is not None else pb.VERDICT_UNSPECIFIED

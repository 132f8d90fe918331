"""Protobuf <-> domain translation for the coordinator's gRPC shell.

The servicer only translates and delegates: requests become core
events (`bagel.coordinator.core.domain`), outcomes become responses. Everything here is a
pure function of its arguments. Enum numbers are shared by the proto and the domain, so
enums translate by value. Incoming messages have already passed `bagel.protocol.validation`
(strings bounded, floats finite, cells real), so these functions do not re-check them.
"""

from __future__ import annotations

from bagel.coordinator.core.events import Heartbeat, Leave, Register, ReportRound
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.messages import Instruction, LocalState, Member, PeerAddress, Phase, Profile, Verdict

# ---------------------------------------------------------------- proto -> domain


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
    )


def local_from_pb(p: pb.LocalState) -> LocalState:
    return LocalState(cell_id=p.cell_id, committed_round=p.committed_round, state_hash=p.state_hash)


def register_event(worker_id: str, req: pb.RegisterRequest) -> Register:
    return Register(
        worker_id=worker_id,
        profile=profile_from_pb(req.profile),
        peer=peer_from_pb(req.peer),
        local=local_from_pb(req.local),
    )


def heartbeat_event(worker_id: str, req: pb.HeartbeatRequest) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id,
        phase=Phase(req.phase),
        cell_id=req.cell_id,
        round=req.round,
        inner_step=req.inner_step,
        loss=req.loss,
        samples=req.samples,
        local=local_from_pb(req.local),
        reduce_attempt=req.reduce_attempt,
        round_attempt=req.round_attempt,
    )


def report_event(worker_id: str, req: pb.ReportRoundRequest) -> ReportRound:
    return ReportRound(
        worker_id=worker_id,
        cell_id=req.cell_id,
        round=req.round,
        state_hash=req.state_hash,
        samples=req.samples,
        loss=req.loss,
        compute_ms=req.compute_ms,
        comm_ms=req.comm_ms,
        bytes_sent=req.bytes_sent,
        bytes_received=req.bytes_received,
        failed=req.failed,
        reason=req.reason,
        reduce_attempt=req.reduce_attempt,
    )


def leave_event(worker_id: str, req: pb.LeaveRequest) -> Leave:
    return Leave(worker_id=worker_id, reason=req.reason, offer_checkpoint=req.offer_checkpoint)


# ---------------------------------------------------------------- domain -> proto


def peer_to_pb(p: PeerAddress) -> pb.PeerAddress:
    return pb.PeerAddress(peer_id=p.peer_id, maddrs=p.maddrs)


def member_to_pb(m: Member) -> pb.Member:
    return pb.Member(worker_id=m.worker_id, peer=peer_to_pb(m.peer), max_samples=m.max_samples)


def instruction_to_pb(ins: Instruction | None) -> pb.Instruction:
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
            )
        )
    if ins.contributors:
        out.contributors.extend(member_to_pb(m) for m in ins.contributors)
    if ins.donor is not None:
        dn = ins.donor
        out.donor.CopyFrom(
            pb.Donor(worker_id=dn.worker_id, peer=peer_to_pb(dn.peer), checkpoint_round=dn.checkpoint_round)
        )
    return out


VERDICTS = {
    Verdict.PENDING: pb.VERDICT_PENDING,
    Verdict.COMMITTED: pb.VERDICT_COMMITTED,
    Verdict.RESYNC: pb.VERDICT_RESYNC,
    Verdict.ABORTED: pb.VERDICT_ABORTED,
}


def verdict_to_pb(v: Verdict | None) -> int:
    return VERDICTS.get(v, pb.VERDICT_UNSPECIFIED) if v is not None else pb.VERDICT_UNSPECIFIED

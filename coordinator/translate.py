"""Protobuf <-> domain translation for the coordinator's gRPC shell.

The servicer only translates and delegates: requests become core
events (`bagel.coordinator.core.domain`), outcomes become responses. Everything here is a
pure function of its arguments. The message types themselves (instructions, profiles,
local states, verdicts) translate in `bagel.protocol.convert`, which the worker shares;
this module adds the core's events. Enum numbers are shared by the proto and the domain,
so enums translate by value. Incoming messages have already passed `bagel.protocol.validation`
(strings bounded, floats finite, cells real), so these functions do not re-check them.
"""

from __future__ import annotations

from bagel.coordinator.core.events import Heartbeat, Leave, Register, ReportRound
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.convert import (  # the message types' own translations, shared with the worker
    VERDICTS,
    audit_from_pb,
    instruction_to_pb,
    local_from_pb,
    member_to_pb,
    peer_from_pb,
    peer_to_pb,
    profile_from_pb,
    verdict_to_pb,
)
from bagel.protocol.messages import DonorRate, PeerRates, Phase
from bagel.protocol.runspec import MAX_SYNC_DONORS

# ---------------------------------------------------------------- proto -> domain


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
        donor_rates=tuple(DonorRate(d.worker_id, d.nbytes, d.ms) for d in req.donor_rates[:MAX_SYNC_DONORS]),
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
        audit=audit_from_pb(req.audit) if req.HasField("audit") else None,
        heldout_loss=req.heldout_loss if req.HasField("heldout_loss") else None,
        heldout_loss_base=req.heldout_loss_base if req.HasField("heldout_loss_base") else None,
        peer_rates=PeerRates.of((r.worker_id, r.nbytes, r.ms) for r in req.peer_rates),
    )


def leave_event(worker_id: str, req: pb.LeaveRequest) -> Leave:
    return Leave(worker_id=worker_id, reason=req.reason, offer_checkpoint=req.offer_checkpoint)


__all__ = [
    "VERDICTS",
    "heartbeat_event",
    "instruction_to_pb",
    "leave_event",
    "local_from_pb",
    "member_to_pb",
    "peer_from_pb",
    "peer_to_pb",
    "profile_from_pb",
    "register_event",
    "report_event",
    "verdict_to_pb",
]

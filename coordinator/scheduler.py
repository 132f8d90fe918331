"""The scheduler: which worker trains which cell, and how a round's batch is split.

API skeleton (behaviour lands in the next commits). Pure functions of their inputs,
used unchanged by the daemon (through CoordinatorState) and the simulator.

    assign(workers, cell_memory, cell_targets, knobs) -> {worker_id: cell_id | ""}
    plan_round(members, spec, now_ms, policy, payload_bytes) -> Planning
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bagel.coordinator.domain import MemberPlan, PeerAddress
from bagel.coordinator.policy import Policy
from bagel.coordinator.spec import RunSpec


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the scheduler knows of a worker."""

    worker_id: str
    vram_bytes: int
    throughput: Mapping[str, float]  # samples/s estimate by cell id
    reputation: float = 0.0
    cell_id: str = ""  # current cell ("" = none)
    movable: bool = True  # False: stays where it is now (mid-round)
    sticky: bool = True  # moving it costs a state download


@dataclass(frozen=True, slots=True)
class Knobs:
    min_replicas: int = 2
    max_replicas: int = 8
    vram_headroom: float = 0.2
    stickiness: float = 0.1
    ban_reputation: float = -5.0
    max_moves: int = 4
    candidates: int = 32

    @classmethod
    def from_spec(cls, spec: RunSpec, policy: Policy) -> Knobs:
        s = spec.schedule
        return cls(
            min_replicas=s.min_replicas,
            max_replicas=s.max_replicas,
            vram_headroom=s.vram_headroom,
            stickiness=s.stickiness,
            ban_reputation=s.ban_reputation,
            max_moves=policy.max_moves_per_event,
            candidates=policy.repair_candidates,
        )


@dataclass(frozen=True, slots=True)
class PlanMember:
    worker_id: str
    peer: PeerAddress
    samples_per_s: float
    bandwidth_bytes_per_s: float = 0.0  # 0 = unknown


@dataclass(frozen=True, slots=True)
class Planning:
    inner_steps: int
    members: tuple[MemberPlan, ...]
    deadline_ms: int
    predicted_compute_ms: int
    predicted_comm_ms: int
    extra: Mapping[str, float] = field(default_factory=dict)


def fits(vram_bytes: int, memory_bytes: int, headroom: float) -> bool:
    """A cell fits a worker when its memory needs at most (1 - headroom) of the VRAM."""
    return memory_bytes <= vram_bytes * (1.0 - headroom)


def assign(
    workers: Sequence[WorkerView],
    cell_memory: Mapping[str, int],
    cell_targets: Mapping[str, float],
    knobs: Knobs,
) -> dict[str, str]:
    """New assignment worker_id -> cell_id ("" = standby)."""
    raise NotImplementedError


def plan_round(
    members: Sequence[PlanMember],
    spec: RunSpec,
    now_ms: int,
    policy: Policy,
    payload_bytes: int,
) -> Planning:
    """Per-member micro_batch/grad_accum and the round's deadline."""
    raise NotImplementedError

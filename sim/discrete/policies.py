"""Policies the simulator compares, as a registry of plug-ins.

A `SimPolicy` is the coordinator's own `bagel.coordinator.core.policy.Policy` (the knobs the
daemon's core and scheduler read: batch split, wait-for-all, fail-fast leases, deadline
slack, H) plus the little the *workers* do differently under a baseline, which the core
cannot know about:

- `bagel`: the daemon's policy object itself (`coordinator.policy.BAGEL`), unchanged:
  throughput-proportional batches, deadlines that freeze whoever is ready, leases that
  fail fast, late join. Workers behave as the real worker does, including the run spec's
  `[diloco] overlap` (training the next round ahead during the exchange) and `[sync]
  catch_up_rounds` (a worker a round or two behind catches up by the committed updates).
- `diloco_wait_all`: `coordinator.policy.DILOCO_WAIT_ALL`, unchanged: equal batches, a round
  freezes only when every live member is ready, a dead member is noticed only at the
  round's timeout (DiLoCo, Douillard et al. 2023, as usually deployed with a plain
  all-reduce barrier, whose GPUs wait for the exchange: `overlap` is forced "off"; every
  sync downloads the whole state: `catch_up_rounds` is 0).
- `sync_dp`: `coordinator.policy.SYNC_DP` (equal batches, wait for all, no fail-fast) with
  `inner_steps` = K, the run's codec forced to fp32, no overlap (every step waits for
  its all-reduce) and no catch-up by updates (a joiner downloads the state). Synchronous
  data parallel exchanges fp32 gradients every step; simulating every step as its own
  core round would take 10^5 core rounds per cell per day, so one core round stands for
  K lock-step steps:
  the workers are *lock-stepped* (every step waits for the slowest member, so all members
  are READY after K x the slowest member's step time) and the round's exchange is K fp32
  all-reduces (`comm_rounds = K`; the core is told payload_bytes = K x the fp32 gradient,
  so its reduce deadline covers them). A member that dies mid-round stalls the lock-step
  collective, exactly as NCCL/gloo do, until the core's round timeout aborts the round.
  K comes from the scenario (`engine.sync_dp_steps_per_round`, 0 = automatic: a typical
  cell's round lasts `engine.sync_dp_min_round_s`, see
  `engine.sync_steps_per_round`). What this folding does
  not model: a failure between two steps of the same block loses the block's earlier
  steps too (in a real job only the current step is lost, if it checkpoints every step).

Register a new policy with `register(SimPolicy(...))`; `get(name)` looks one up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from bagel.coordinator.core import policy as core_policy
from bagel.coordinator.core.policy import Policy


@dataclass(frozen=True)
class SimPolicy:
    name: str
    core: Policy  # what CoordinatorState runs with
    # run-spec section overrides, e.g. {"diloco": {"codec": "fp32"}}
    spec_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # members advance in lock-step: all are READY after inner_steps x the slowest step time
    lockstep: bool = False
    # all-reduces per round: 1 (DiLoCo: one pseudo-gradient per round) or "steps" (every step)
    comm_every_step: bool = False
    description: str = ""
    # how costly a simulated day of it is, relative to the others (the runner starts the
    # costliest first, so it keeps a core to itself): bagel simulates the most member-rounds
    sim_cost: int = 1

    def resolved(self, steps_per_round: int) -> SimPolicy:
        """sync_dp-style policies get their K; others are returned unchanged."""
        if self.comm_every_step:
            return replace(self, core=replace(self.core, inner_steps=steps_per_round))
        return self


_REGISTRY: dict[str, SimPolicy] = {}


def register(p: SimPolicy) -> SimPolicy:
    if p.name in _REGISTRY:
        raise ValueError(f"policy {p.name!r} is already registered")
    if p.core.name != p.name:
        raise ValueError(f"policy {p.name!r}: its core Policy is named {p.core.name!r}")
    _REGISTRY[p.name] = p
    return p


def get(name: str) -> SimPolicy:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(_REGISTRY)}") from None


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


BAGEL = register(
    SimPolicy(
        "bagel",
        core_policy.BAGEL,
        description="throughput-proportional batches, deadlines, fail-fast leases (the daemon's policy)",
        sim_cost=3,
    )
)
DILOCO_WAIT_ALL = register(
    SimPolicy(
        "diloco_wait_all",
        core_policy.DILOCO_WAIT_ALL,
        spec_overrides={"diloco": {"overlap": "off"}, "sync": {"catch_up_rounds": 0}},
        description="DiLoCo, equal batches, every round waits for all members",
    )
)
SYNC_DP = register(
    SimPolicy(
        "sync_dp",
        core_policy.SYNC_DP,
        spec_overrides={"diloco": {"codec": "fp32", "overlap": "off"}, "sync": {"catch_up_rounds": 0}},
        lockstep=True,
        comm_every_step=True,
        description="synchronous data parallel: fp32 all-reduce every step, everyone waits for the slowest",
        sim_cost=2,
    )
)

"""Audits end to end over the real data plane: the real coordinator core (under fake time)
plans and freezes each round, real hivemind peers exchange the pseudo-gradients
(`DataPlane.all_reduce` with the int8 codec), every reducer's audit of its part travels in
its ReportRound, and the core confirms or ignores the findings.

- 50 honest rounds of 5 workers: no honest worker is banned, no contribution is rejected
  (the counts are asserted and printed);
- freeload-zero, freeload-replay and budget-liar, among four honest workers, are banned
  within 3 audited rounds, through the real worker functions that make their updates and
  figures (`roundwork.corrupt`, `roundwork.claimed`).

The honest updates are synthetic (no model is trained: two shared cores cannot train 50
rounds of five models in a test): each is a drift shared by the round, correlated from one
round to the next as DiLoCo's pseudo-gradients are, plus the worker's own part, so honest
updates are similar to each other and to their own previous ones, but never equal.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from bagel.coordinator.core.records import WorkerState
from bagel.protocol.messages import Order
from bagel.worker.roundwork import claimed, corrupt

from dataplane_peers import Peer, peers, torch_shm_manager  # noqa: F401 (a fixture)
from test_state_harness import Harness, h, make_spec

NUMEL = 6_000
ROUND_MS = 3_000  # the fake time one round of training takes


class Updates:
    """Synthetic honest pseudo-gradients: drift_t = 0.8 drift_{t-1} + 0.6 noise (shared by
    the round), update = drift_t + the worker's own noise, so honest updates of one round
    have a cosine of about 0.5 with each other and with their own previous one."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.drift = torch.randn(NUMEL, generator=self.g)

    def next_round(self) -> None:
        self.drift = 0.8 * self.drift + 0.6 * torch.randn(NUMEL, generator=self.g)

    def honest(self) -> torch.Tensor:
        return 1e-3 * (self.drift + torch.randn(NUMEL, generator=self.g))


async def run_rounds(
    ps: list[Peer], modes: dict[str, str], rounds: int, *, stop_when_banned: bool = False
) -> tuple[Harness, dict[str, int], dict[str, int]]:
    """Drive the core and the data plane for `rounds` rounds; returns the harness, the round
    each worker was banned in, and the exclusions every reducer made, by sender."""
    hz = Harness(make_spec())
    by_id = {p.worker_id: p for p in ps}
    for p in ps:
        hz.reg(p.worker_id, speed=100.0)
    hz.hb(ps[0].worker_id)
    ups = Updates(0)
    first: dict[str, dict[str, torch.Tensor]] = {}
    last: dict[str, dict[str, torch.Tensor]] = {}
    banned: dict[str, int] = {}
    excluded: dict[str, int] = {}
    for rnd in range(1, rounds + 1):
        ups.next_round()
        live = [w for w in by_id if hz.store.workers[w].state is WorkerState.ACTIVE]
        hz.advance(ROUND_MS)
        for w in live:
            if hz.st.instruction_for(w).order is Order.SYNC:
                hz.sync(w)  # a straggler of the last round fetches the state
            if hz.st.instruction_for(w).order is Order.TRAIN:
                hz.ready(w)
        # a worker banned while the exchange is open makes the core re-freeze the others
        # without it: the survivors redo only the exchange, until the round is decided
        for _attempt in range(4):
            live = [w for w in by_id if hz.store.workers[w].state is WorkerState.ACTIVE]
            if hz.store.cells["k0.r0"].committed_round >= rnd and _attempt > 0:
                break
            if _attempt > 0 and not any(hz.st.instruction_for(w).order is Order.REDUCE for w in live):
                break
            reducing = [w for w in live if hz.st.instruction_for(w).order is Order.REDUCE]
            assert reducing, f"round {rnd}: nobody is reducing"
            ins = hz.st.instruction_for(reducing[0])
            budgets = {m.worker_id: m.max_samples for m in ins.contributors}
            contributors = [by_id[m.worker_id].contributor(max(1, m.max_samples)) for m in ins.contributors]
            deltas = {}
            for w in budgets:
                if budgets[w] == 0:  # a catch-up contributor (a straggler of the last round): zeros, weight 0
                    deltas[w] = {"x": torch.zeros(NUMEL)}
                    continue
                honest = {"x": ups.honest()}
                deltas[w] = corrupt(honest, modes[w], last.get(w), first.get(w)) if modes.get(w) else honest
                first.setdefault(w, honest)
                last[w] = honest
            results = await asyncio.gather(
                *(
                    by_id[w].plane.all_reduce(
                        worker_id=w,
                        cell_id="k0.r0",
                        round=rnd,
                        round_attempt=ins.round_attempt,
                        reduce_attempt=ins.reduce_attempt,
                        contributors=contributors,
                        delta=deltas[w],
                        weight=float(budgets[w]),
                        codec="int8",
                        timeout_s=60.0,
                        audit_blocks=hz.spec.audit.sketch_blocks,
                    )
                    for w in budgets
                )
            )
            res = dict(zip(budgets, results, strict=True))
            for r in res.values():
                for e in r.excluded:
                    if budgets[e.sender] > 0:  # a catch-up contributor abstains by design
                        excluded[e.sender] = excluded.get(e.sender, 0) + 1
            # the Byzantine ones report first, so they count in the quorum rather than as stragglers
            for w in sorted(budgets, key=lambda x: (x not in modes, x)):
                if hz.store.workers[w].state is not WorkerState.ACTIVE:
                    continue
                now = hz.st.instruction_for(w)
                if now.order is Order.REDUCE and now.reduce_attempt != ins.reduce_attempt:
                    continue  # a ban during the exchange re-froze the set without the banned worker
                p = hz.st.instruction_for(w).plan if hz.st.instruction_for(w).order is Order.REDUCE else None
                plan_samples = p.micro_batch * p.grad_accum * p.inner_steps if p is not None else budgets[w]
                samples, compute_ms = claimed(modes.get(w, ""), plan_samples, ROUND_MS - 100)
                hz.report(
                    w,
                    h(rnd),
                    round=rnd,
                    reduce_attempt=ins.reduce_attempt,
                    samples=samples,
                    compute_ms=compute_ms,
                    audit=res[w].audit,
                )
        for w in by_id:
            if w not in banned and hz.store.workers[w].state is WorkerState.BANNED:
                banned[w] = rnd
        if stop_when_banned and set(modes) <= set(banned):
            break
    return hz, banned, excluded


@pytest.mark.timeout(600)
async def test_fifty_honest_rounds_ban_nobody_and_reject_nothing() -> None:
    async with peers(5) as ps:
        hz, banned, excluded = await run_rounds(ps, {}, 50)
    counts = dict(hz.st.auditor.counts)
    print(f"\n50 honest rounds of 5 workers: commits {len(hz.store.commits)}, banned {banned}, excluded {excluded}")
    print(f"audit counts: {counts}")
    assert len(hz.store.commits) == 50
    assert banned == {} and excluded == {}
    assert counts.get("confirmed", 0) == 0
    assert not {k: v for k, v in counts.items() if k.startswith("flag_")}, counts
    assert counts["audits"] >= 50 * 3 and counts.get("audits_ignored", 0) == 0
    assert counts.get("lies", 0) == 0
    assert all(w.reputation >= 0 for w in hz.store.workers.values())


@pytest.mark.timeout(600)
async def test_freeloaders_are_banned_within_three_audited_rounds() -> None:
    modes = {"w4": "freeload-zero", "w5": "freeload-replay", "w6": "budget-liar"}
    async with peers(7) as ps:
        hz, banned, _ = await run_rounds(ps, modes, 6, stop_when_banned=True)
    reasons = {w: hz.store.workers[w].reason for w in modes}
    print(f"\nbanned in round: {banned}; reasons: {reasons}; audit counts: {dict(hz.st.auditor.counts)}")
    assert set(banned) == set(modes), banned
    # (freeload-replay sends an honest first round: it replays from round 2 on)
    assert max(banned.values()) <= 3, banned
    assert "zero" in reasons["w4"] and "replay" in reasons["w5"] and "budget" in reasons["w6"]
    assert all(hz.store.workers[f"w{i}"].state is WorkerState.ACTIVE for i in range(4))
    assert not any(f.worker_id not in modes for f in hz.st.auditor.findings)

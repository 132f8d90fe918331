"""Test harness for the coordinator core (no tests here): fake time, a fake store that
applies every Outcome's effects, and a check that the store always equals the state.

The store check is what makes the effects trustworthy: after every transition the rows
the shell would have written must equal `snapshot()`, so a changed record that a
transition forgot to emit fails the test that caused it.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from bagel.coordinator.core.events import Heartbeat, Outcome, Register, ReportRound, Tick
from bagel.coordinator.core.policy import BAGEL, Policy
from bagel.coordinator.core.records import CellConfig, CellRecord, CommitRecord, RoundRecord, WorkerRecord
from bagel.coordinator.core.state import CoordinatorState
from bagel.protocol.messages import Instruction, LocalState, Order, PeerAddress, Phase, Profile
from bagel.protocol.runspec import ROUTER_CELL, RunSpec, parse_spec

GB = 1 << 30
T0 = 1_700_000_000_000


def make_spec(
    clusters: int = 1,
    ranges: int = 1,
    router: bool = False,
    group_batch: int = 64,
    max_micro_batch: int = 16,
    **schedule: Any,
) -> RunSpec:
    sched = dict(
        min_replicas=1,
        max_replicas=8,
        lease_s=10.0,
        heartbeat_s=2.0,
        deadline_slack=2.0,
        min_round_s=5.0,
        quorum=0.5,
        stickiness=0.1,
    )
    checkpoint_every = schedule.pop("every_rounds", 2)
    sched.update(schedule)
    lines = "\n".join(f"{k} = {v!r}".replace("True", "true").replace("False", "false") for k, v in sched.items())
    text = f"""
[run]
id = "test-run"
[data]
clusters = {clusters}
[cells]
timestep_ranges = {ranges}
router = {"true" if router else "false"}
[diloco]
inner_steps = 10
group_batch = {group_batch}
max_micro_batch = {max_micro_batch}
[schedule]
{lines}
[checkpoint]
every_rounds = {checkpoint_every}
"""
    return parse_spec(text)


def make_cells(
    spec: RunSpec, expert_gb: float = 9, router_gb: float = 2, targets: dict[str, float] | None = None
) -> list[CellConfig]:
    out = []
    for c in spec.cell_ids:
        mem = int((router_gb if c == ROUTER_CELL else expert_gb) * GB)
        share = (targets or {}).get(c, 0.2 if c == ROUTER_CELL else 1.0)
        out.append(CellConfig(c, mem, share, payload_bytes=25_000_000))  # 1 s on a 50 MB/s link
    return out


def profile(
    spec: RunSpec,
    vram_gb: float = 24,
    speed: float = 100.0,
    bw: float = 50e6,
    host_gb: float = 0.0,
    device_kind: str = "cuda",
) -> Profile:
    """A worker `speed` samples/s on an expert cell and 5x that on the router (host_gb 0:
    declares no host RAM)."""
    return Profile(
        name="t",
        device_kind=device_kind,
        vram_bytes=int(vram_gb * GB),
        link_bandwidth_bytes_per_s=bw,
        samples_per_s={c: speed * (5.0 if c == ROUTER_CELL else 1.0) for c in spec.cell_ids},
        host_memory_bytes=int(host_gb * GB),
    )


def h(n: int) -> str:
    return f"{n:064x}"


class FakeStore:
    """Applies effects the way the SQLite store does: upsert by key, append commits."""

    def __init__(self, st: CoordinatorState) -> None:
        snap = st.snapshot()
        self.workers: dict[str, WorkerRecord] = {w.worker_id: w for w in snap.workers}
        self.cells: dict[str, CellRecord] = {c.cell_id: c for c in snap.cells}
        self.rounds: dict[tuple[str, int, int], RoundRecord] = {r.key: r for r in snap.rounds}
        self.commits: list[CommitRecord] = list(snap.commits)

    def write(self, effects: tuple[Any, ...]) -> None:
        for e in effects:
            if isinstance(e, WorkerRecord):
                self.workers[e.worker_id] = e
            elif isinstance(e, CellRecord):
                self.cells[e.cell_id] = e
            elif isinstance(e, RoundRecord):
                self.rounds[e.key] = e
            elif isinstance(e, CommitRecord):
                self.commits.append(e)
            else:  # pragma: no cover - a bug in the core
                raise AssertionError(f"unexpected effect {e!r}")

    def check(self, st: CoordinatorState) -> None:
        snap = st.snapshot()
        assert self.workers == {w.worker_id: w for w in snap.workers}
        assert self.cells == {c.cell_id: c for c in snap.cells}
        for r in snap.rounds:
            assert self.rounds[r.key] == r
        open_keys = {r.key for r in snap.rounds}
        for k, r in self.rounds.items():
            if k not in open_keys:
                assert r.state.terminal, f"round {k} is {r.state} in the store but not open in the state"
        assert len({(c.cell_id, c.round) for c in self.commits}) <= len(self.commits)

    def restore(self, spec: RunSpec, cells: list[CellConfig], now: int, **kw: Any) -> CoordinatorState:
        return CoordinatorState.restore(
            spec,
            cells,
            workers=self.workers.values(),
            cell_records=self.cells.values(),
            rounds=self.rounds.values(),
            commits=self.commits,
            now_ms=now,
            **kw,
        )


class Harness:
    """A CoordinatorState under fake time; every apply is checked against a FakeStore."""

    def __init__(
        self, spec: RunSpec | None = None, policy: Policy = BAGEL, cells: list[CellConfig] | None = None, **kw: Any
    ) -> None:
        self.spec = spec or make_spec()
        self.cells = cells or make_cells(self.spec)
        self.now = T0
        self.st = CoordinatorState(self.spec, self.cells, policy=policy, rng=random.Random(7), now_ms=self.now, **kw)
        self.store = FakeStore(self.st)
        self.last: dict[str, Instruction] = {}

    def advance(self, ms: int) -> None:
        self.now += ms

    def apply(self, event: Any) -> Outcome:
        out = self.st.apply(self.now, event)
        self.store.write(out.effects)
        self.store.check(self.st)
        wid = getattr(event, "worker_id", None)
        if wid is not None and out.instruction is not None:
            self.last[wid] = out.instruction
        return out

    def reg(
        self,
        wid: str,
        vram_gb: float = 24,
        speed: float = 100.0,
        local: LocalState | None = None,
        bw: float = 50e6,
        **mem: Any,  # host_gb, device_kind: see `profile`
    ) -> Outcome:
        return self.apply(
            Register(
                wid,
                profile(self.spec, vram_gb, speed, bw, **mem),
                PeerAddress(f"peer-{wid}", ("/ip4/127.0.0.1/tcp/1",)),
                local or LocalState(),
            )
        )

    def local(self, wid: str) -> LocalState:
        return self.store.workers[wid].local

    def hb(self, wid: str, phase: Phase = Phase.IDLE, **kw: Any) -> Outcome:
        ins = self.st.instruction_for(wid)
        kw.setdefault("cell_id", ins.cell_id)
        kw.setdefault("round", ins.round)
        kw.setdefault("round_attempt", ins.round_attempt)
        kw.setdefault("local", self.local(wid))
        return self.apply(Heartbeat(wid, phase, **kw))

    def ready(self, wid: str, samples: int | None = None, **kw: Any) -> Outcome:
        ins = self.st.instruction_for(wid)
        assert ins.order is Order.TRAIN, ins
        assert ins.plan is not None
        full = ins.plan.micro_batch * ins.plan.grad_accum * ins.plan.inner_steps
        self.advance(50)  # training takes time: the core credits samples by the span it saw
        return self.hb(wid, Phase.READY, samples=full if samples is None else samples, **kw)

    def report(self, wid: str, state_hash: str, **kw: Any) -> Outcome:
        ins = self.st.instruction_for(wid)
        kw.setdefault("cell_id", ins.cell_id)
        kw.setdefault("round", ins.round)
        kw.setdefault("reduce_attempt", ins.reduce_attempt)
        p = ins.plan  # an honest report claims exactly its budget (0 for a catch-up)
        kw.setdefault("samples", p.micro_batch * p.grad_accum * p.inner_steps if p is not None else 0)
        kw.setdefault("compute_ms", 6_400)
        return self.apply(ReportRound(wid, state_hash=state_hash, **kw))

    def tick(self) -> Outcome:
        return self.apply(Tick())

    def keepalive(self, until_ms: int, *ids: str, step_ms: int = 2_000) -> None:
        """Advance to `until_ms` in heartbeat steps; the named workers heartbeat what they are
        doing (a phase that changes nothing), and the coordinator ticks at every step."""
        while self.now < until_ms:
            self.now = min(until_ms, self.now + step_ms)
            for wid in ids:
                ins = self.st.instruction_for(wid)
                phase = {Order.TRAIN: Phase.TRAINING, Order.REDUCE: Phase.REDUCING}.get(ins.order, Phase.IDLE)
                self.hb(wid, phase, reduce_attempt=ins.reduce_attempt)
            self.tick()

    def sync(self, wid: str) -> Outcome:
        """Pretend the worker fetched the committed state it was told to, and say so."""
        ins = self.st.instruction_for(wid)
        assert ins.order is Order.SYNC, ins
        local = LocalState(ins.cell_id, ins.committed_round, ins.committed_hash)
        return self.hb(wid, Phase.IDLE, local=local)

    def round(self, cell: str | None = None) -> RoundRecord | None:
        c = cell or self.spec.cell_ids[0]
        return self.st.cell_view(c)[1]

    def cell(self, cell: str | None = None) -> CellRecord:
        return self.st.cell_view(cell or self.spec.cell_ids[0])[0]


def restored(hz: Harness, **kw: Any) -> CoordinatorState:
    return hz.store.restore(hz.spec, hz.cells, hz.now, **kw)


__all__ = ["GB", "T0", "FakeStore", "Harness", "h", "make_cells", "make_spec", "profile", "replace", "restored"]

"""The real worker, the simulator, the test workers and the load generator decide alike:
all four follow an instruction through the one `bagel.worker.reconciler.decide` (and read
a verdict through `decide_verdict`), as the daemon and the simulator share the
coordinator's core and scheduler (test_sim_engine.py).

Each caller is driven briefly with `decide` wrapped by a counting spy, which records who
called it; a caller that decided on its own (or bound `decide` at import time, out of
the spy's reach) fails here. A static check reads the same off the callers' source.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib.util
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import bagel.sim.discrete.workers as sim_workers
import bagel.worker.agent as agent_mod
import bagel.worker.orders as orders_mod
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.convert import instruction_to_pb
from bagel.protocol.messages import Instruction, Member, Order, PeerAddress, RoundPlan
from bagel.sim.discrete import policies
from bagel.sim.discrete.engine import Engine
from bagel.sim.discrete.scenario import load_sim_scenario
from bagel.worker import reconciler
from bagel.worker.display import Display

from simworkers import SimWorker

ROOT = Path(__file__).resolve().parent.parent
CALLERS = {
    "agent": ROOT / "worker" / "agent.py",
    "simulator": ROOT / "sim" / "discrete" / "workers.py",
    "simworkers": ROOT / "tests" / "simworkers.py",
    "load": ROOT / "bench" / "coordinator_load.py",
}
# where each caller reads a ReportRound verdict (the agent's report lives with its orders)
VERDICT_READERS = {**CALLERS, "agent": ROOT / "worker" / "orders.py"}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Wrap reconciler.decide; count the calls per calling file."""
    seen: Counter[str] = Counter()
    real = reconciler.decide
    by_path = {p.resolve(): name for name, p in CALLERS.items()}

    @functools.cache
    def caller(filename: str) -> str:
        # resolved: the tree may be imported through links (a PYTHONPATH of symlinks)
        return by_path.get(Path(filename).resolve(), "other")

    def counting(i: Instruction, view: reconciler.WorkerView) -> tuple[reconciler.Action, ...]:
        seen[caller(sys._getframe(1).f_code.co_filename)] += 1
        return real(i, view)

    monkeypatch.setattr(reconciler, "decide", counting)
    return seen


def round0_train(worker_id: str) -> Instruction:
    plan = RoundPlan(2, 4, 1, 0, (Member(worker_id, PeerAddress("p"), 8),))
    return Instruction(Order.TRAIN, "k0.r0", 1, 0, "", plan=plan, round_attempt=1)


def test_the_callers_bind_the_reconciler_module_itself() -> None:
    # the module the callers hold is the reconciler, so they see what it is now
    assert sim_workers.reconciler is reconciler
    assert agent_mod.reconciler is reconciler
    assert orders_mod.reconciler is reconciler
    for name, path in CALLERS.items():
        assert _calls_of(path, "decide"), f"{name} ({path.name}) does not call reconciler.decide"
        assert "def decide" not in path.read_text(), name
    for name, path in VERDICT_READERS.items():
        assert _calls_of(path, "decide_verdict"), f"{name} ({path.name}) does not call reconciler.decide_verdict"


def test_the_simulator_reacts_only_through_decide(calls: Counter[str], monkeypatch: pytest.MonkeyPatch) -> None:
    reactions = Counter[str]()
    real_react = sim_workers.WorkerBehaviour._react

    def react(self: Any, w: Any, ins: Any) -> None:
        if ins is not None and w.online:
            reactions["n"] += 1
        real_react(self, w, ins)

    monkeypatch.setattr(sim_workers.WorkerBehaviour, "_react", react)
    sc = load_sim_scenario(ROOT / "sim" / "scenarios" / "heterogeneity-10x.toml")
    res = Engine(sc, policies.get("bagel"), workers=40, hours=0.3).run()
    assert res.ledger.committed_rounds > 0
    assert reactions["n"] > 0 and calls["simulator"] == reactions["n"]  # every reaction, none of its own


async def test_a_simworker_follows_decide(calls: Counter[str]) -> None:
    w = SimWorker("127.0.0.1:9", "run", train_s=30.0)  # (no coordinator: nothing is sent)
    try:
        w._act(round0_train(w.worker_id))
        assert calls["simworkers"] == 1
        assert w.local.cell_id == "k0.r0" and w.work is not None and w.work.round == 1  # built round 0, training
    finally:
        await w.close()


def test_the_load_generator_follows_decide(calls: Counter[str], monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("coordinator_load_under_test", CALLERS["load"])
    assert spec is not None and spec.loader is not None
    load = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, load)  # (its dataclasses look their module up)
    spec.loader.exec_module(load)
    fleet = load.Fleet(1, [None] * load.CHANNELS, {}, lambda coro: coro.close())
    fleet.act(0, instruction_to_pb(round0_train(fleet.sims[0].identity.worker_id)))
    assert calls["load"] == 1
    assert fleet.sims[0].work is not None and fleet.heartbeat(0).phase == pb.PHASE_READY


class _FakeOrders:
    """What the agent's reconcile step talks to, minus the jobs."""

    def __init__(self, view: reconciler.WorkerView) -> None:
        self._view = view
        self.performed: list[reconciler.Action] = []

    def view(self, uploaded: frozenset[tuple[str, int]]) -> reconciler.WorkerView:
        return self._view

    async def perform(self, i: Instruction, a: reconciler.Action) -> bool:
        self.performed.append(a)
        return True

    def phase(self) -> int:
        return pb.PHASE_TRAINING


def test_the_agent_performs_what_decide_returns(calls: Counter[str]) -> None:
    agent = object.__new__(agent_mod.Agent)  # its reconcile step only: no identity, DHT or link
    view = reconciler.WorkerView("w-me")
    agent.instr = round0_train("w-me")
    agent._uploads = set()
    agent.display = Display("quiet")
    agent.orders = _FakeOrders(view)  # type: ignore[assignment]
    asyncio.run(agent._reconcile())
    assert calls["agent"] == 1
    assert agent.orders.performed == list(reconciler.decide(agent.instr, view))  # type: ignore[attr-defined]
    assert agent.orders.performed == [reconciler.BuildInitialState("k0.r0"), reconciler.StartTrain(0)]  # type: ignore[attr-defined]


def _calls_of(path: Path, name: str) -> bool:
    """Does the file call `<alias>.name(...)` on an alias of bagel.worker.reconciler?"""
    tree = ast.parse(path.read_text())
    aliases = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "bagel.worker"
        for a in node.names
        if a.name == "reconciler"
    }
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == name
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in aliases
        for node in ast.walk(tree)
    )

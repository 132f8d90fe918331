"""The commit guard through the worker's path: a real inner round of the tiny DiT, the real
outer step, the worker's held-out measurement (`Orders._measure`, `worker/heldout.py`),
the wire (the request the client sends, validated and translated as the server does) and
the core's verdict.

- the measurement is deterministic: two independent probes (fresh models, as two members
  would have) give the same number for the same state, on the CPU;
- an honest round's new state passes the guard and commits;
- the same round with a blown-up pseudo-gradient (`--byzantine scale`, x100) makes the
  held-out loss jump, and the coordinator refuses to commit it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from bagel.coordinator.core.records import RoundState
from bagel.coordinator.translate import report_event
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.runspec import parse_spec
from bagel.protocol.validation import validate_report_round
from bagel.worker import ddp
from bagel.worker.diloco import CellState, OuterConfig, outer_step
from bagel.worker.heldout import HeldoutProbe
from bagel.worker.localstate import LocalCheckpoint
from bagel.worker.orders import Orders
from bagel.worker.roundwork import ReduceOutcome, RoundWork, corrupt, train_round
from bagel.worker.trainer import InnerPlan, build_runtime

from test_state_harness import Harness, make_cells

SPEC = """
[run]
id = "guard"
seed = 0
[model]
arch = "dit"
preset = "tiny"
image_size = 8
channels = 1
num_classes = 10
[data]
source = "digits"
clusters = 1
holdout_fraction = 0.1
[cells]
timestep_ranges = 1
router = false
[diloco]
inner_steps = 8
inner_lr = 0.002
group_batch = 16
[schedule]
min_replicas = 1
quorum = 0.5
[guard]
max_loss_ratio = 2.0
abs_slack = 0.05
eval_samples = 32
"""
CELL = "k0.r0"


def _measured(spec: object, held: LocalCheckpoint, new: CellState) -> ReduceOutcome:
    """What `Orders._reduce` does after the exchange: measure the base and the new state."""
    out = ReduceOutcome(new, new.state_hash(), {}, 0, 0, 0.0)
    orders = SimpleNamespace(host=SimpleNamespace(spec=spec), probe=None)
    asyncio.run(Orders._measure(orders, out, held))  # type: ignore[arg-type]
    return out


def _request(out: ReduceOutcome, rnd: int) -> pb.ReportRoundRequest:
    """The report as `CoordinatorClient.report_round` builds it from `Orders._report`'s fields."""
    req = pb.ReportRoundRequest(cell_id=CELL, round=rnd, state_hash=out.state_hash, samples=128, loss=0.5)
    assert out.heldout_loss is not None and out.heldout_loss_base is not None
    req.heldout_loss, req.heldout_loss_base = out.heldout_loss, out.heldout_loss_base
    return req


@pytest.mark.timeout(300)
def test_the_worker_measures_a_jump_and_the_coordinator_refuses_it() -> None:
    torch.manual_seed(0)
    spec = parse_spec(SPEC)
    rt = build_runtime(spec, CELL, torch.device("cpu"))
    base = CellState.from_model(rt.task.build_model())
    held = LocalCheckpoint(CELL, 0, base, base.state_hash(), {})
    work = RoundWork(CELL, 1, 1, 0, 1, InnerPlan(8, 16, 1), 0)
    res, delta = train_round(spec.run.id, rt, base, work, ddp.DistContext(), False, None)
    assert res.completed

    cfg = OuterConfig.from_spec(spec.diloco)
    honest, hostile = base.clone(), base.clone()
    outer_step(honest, delta, cfg)
    outer_step(hostile, corrupt(delta, "scale", None), cfg)
    good, bad = _measured(spec, held, honest), _measured(spec, held, hostile)

    # deterministic: another member's probe (its own fresh CPU model) measures the same
    other = HeldoutProbe(spec, CELL)
    assert other.loss(honest, good.state_hash) == good.heldout_loss
    assert other.loss(base, held.state_hash) == good.heldout_loss_base == bad.heldout_loss_base
    assert good.heldout_loss is not None and bad.heldout_loss is not None and good.heldout_loss_base is not None
    bound = 2.0 * good.heldout_loss_base + 0.05
    assert good.heldout_loss <= bound < bad.heldout_loss, (good.heldout_loss_base, good.heldout_loss, bad.heldout_loss)

    # the wire and the core: the honest round commits, the blown-up one is refused
    for out, committed in ((good, True), (bad, False)):
        hz = Harness(spec=spec, cells=make_cells(spec))
        hz.reg("solo")
        hz.hb("solo")
        hz.ready("solo")
        req = _request(out, 1)
        validate_report_round(req, spec)
        verdict = hz.apply(report_event("solo", req)).verdict
        cell = hz.cell(CELL)
        if committed:
            assert cell.committed_round == 1 and cell.heldout_loss == out.heldout_loss
            assert verdict is not None and verdict.name == "COMMITTED"
        else:
            assert cell.committed_round == 0 and cell.guard_refusals == 1
            aborted = hz.store.rounds[(CELL, 1, 1)]
            assert aborted.state is RoundState.ABORTED and aborted.reason.startswith("commit guard")
            assert verdict is not None and verdict.name == "ABORTED"

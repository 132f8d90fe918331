"""The commit guard through the worker's path: a real inner round of the tiny DiT, the real
outer step, the worker's held-out measurement (`Orders._measure`, `worker/heldout.py`),
the wire (the request the client sends, validated and translated as the server does) and
the core's verdict.

- the measurement is deterministic: two independent probes (fresh models, as two members
  would have) give the same number for the same state, on the CPU;
- an honest round's new state passes the guard and commits;
- the same round with a blown-up pseudo-gradient (`--byzantine scale`, x100) makes the
  held-out loss jump, and the coordinator refuses to commit it;
- end to end (real processes): a coordinator and one `--byzantine scale` worker; every
  attempt is refused by the guard and nothing is committed.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path
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
from bagel.worker.swarm import CoordinatorProc, Managed, WorkerProc, cleanup, free_port, get_status
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
# the end-to-end run: the same cell with short leases and rounds (as tests/test_e2e.py)
E2E_SPEC = SPEC.replace("inner_steps = 8", "inner_steps = 5").replace(
    "[schedule]\nmin_replicas = 1\n",
    "[schedule]\nmin_replicas = 1\nlease_s = 3.0\nheartbeat_s = 0.5\nmin_round_s = 1.0\ndeadline_slack = 3.0\n",
)


def _measured(spec: object, held: LocalCheckpoint, new: CellState) -> ReduceOutcome:
    """What `Orders._reduce` does after the exchange: measure the base and the new state."""
    out = ReduceOutcome(new, new.state_hash(), {}, 0, 0, 0.0)

    async def ensure_data(cell_id: str) -> None:  # the data is local here
        pass

    orders = SimpleNamespace(host=SimpleNamespace(spec=spec, ensure_data=ensure_data), probe=None)
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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_end_to_end_a_blown_up_round_is_never_committed(tmp_path: Path) -> None:
    """A real coordinator and one real worker whose pseudo-gradient is x100
    (`--byzantine scale`): the worker measures the jump after every outer step and the
    coordinator refuses every attempt (guard refusals in its SQLite store, nothing
    committed), while the worker stays a member in good standing."""
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(E2E_SPEC)
    procs: list[Managed] = []
    with cleanup(procs):
        c = CoordinatorProc.make(spec_path, tmp_path / "coord", tmp_path / "coord.log", port=free_port())
        procs.append(c)
        c.start_and_wait(timeout_s=90)
        w = WorkerProc.make(
            c.join, tmp_path / "solo", tmp_path / "solo.log", name="solo", extra=["--byzantine", "scale"]
        )
        procs.append(w)
        w.start()
        db = tmp_path / "coord" / "coordinator.sqlite3"

        def refusals() -> tuple[int, int]:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
            try:
                rows = [json.loads(r[0]) for r in con.execute("SELECT record FROM cells")]
            finally:
                con.close()
            cell = next(r for r in rows if r["cell_id"] == CELL)
            return int(cell["guard_refusals"]), int(cell["committed_round"])

        deadline = time.monotonic() + 180
        seen = (0, 0)
        while time.monotonic() < deadline and seen[0] < 2:
            assert c.alive(), c.log_text()[-3000:]
            try:
                seen = refusals()
            except (sqlite3.Error, StopIteration):
                pass
            time.sleep(1.0)
        assert seen[0] >= 2, f"no guard refusals after 180 s: {seen}\n{w.log_text()[-3000:]}"
        assert seen[1] == 0, "a blown-up round was committed"
        assert not w.events("committed")
        # pinned to the daemon's certificate, signed with its key: the detailed view lists workers
        status = get_status(c.endpoint, tls_fingerprint=c.tls_fingerprint, key=tmp_path / "coord" / "coordinator.key")
        solo = [x for x in status.workers if x.state == "active"]
        assert len(solo) == 1 and solo[0].reputation >= 0, "the guard charged the member"

"""The run metrics: a short in-process run exports every series with a plausible value, and
the label sets stay bounded however many workers report.

- a real coordinator on port 0 (its Prometheus endpoint on port 0 too) and six simulated
  workers over real gRPC, three on CPU and three claiming an H100, whose reports carry
  the round metrics (phase times, memory, held-out loss); the endpoint is scraped over
  HTTP and parsed with prometheus-client's own parser;
- 1,000 simulated workers' reports through the same `RunBook`, each with a device name of
  its own: the number of series does not grow with the workers, and no worker id is a label.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bagel.coordinator.core.records import CellRecord, MemberPlan, RoundRecord, RoundState, Snapshot
from bagel.coordinator.daemon import start_coordinator
from bagel.coordinator.metrics import PHASES, Metrics, RunBook, worker_class
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.messages import PeerAddress, Profile
from bagel.protocol.runspec import parse_spec

from simworkers import SimWorker, cluster_spec_text, stop_workers, uniform_cells
from test_cluster import wait_for

EXTRA = """
[slo]
round_success = 0.8
window_rounds = 50
cell_sample_target = 100000

[cost]
gpu_hour = { H100 = 2.0 }
cpu_hour = 0.1
"""


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] of every sample the endpoint serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def values(series: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> list[float]:
    return [v for lab, v in series.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]


@pytest.mark.timeout(90)
async def test_short_run_exports_every_metric(tmp_path: Path) -> None:
    spec = parse_spec(cluster_spec_text(extra=EXTRA, min_replicas=2))
    h = await start_coordinator(
        spec,
        tmp_path / "coord",
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        cells=uniform_cells(spec.cell_ids),
        tick_ms=50,
    )
    target = f"127.0.0.1:{h.port}"
    workers = [
        SimWorker(
            target,
            spec.run.id,
            name=f"m{i}",
            cells=spec.cell_ids,
            seed=i,
            heldout=0.3,
            **({"device_kind": "cuda", "device_name": "NVIDIA H100 80GB HBM3"} if i % 2 else {}),
        )
        for i in range(6)
    ]
    for w in workers:
        w.start()
    try:
        await wait_for(
            lambda: all(c.committed_round >= 2 for c in h.state.snapshot().cells), 60, "2 commits in every cell"
        )
        await asyncio.sleep(1.3)  # the windowed gauges are published by the tick loop once a second
        assert h.metrics_port is not None
        committed = {c.cell_id: c.committed_round for c in h.state.snapshot().cells}  # before the scrape
        m = scrape(h.metrics_port)
    finally:
        await stop_workers(workers)
        await h.stop()

    cells = spec.cell_ids
    assert values(m, "bagel_info", run_id=spec.run.id, spec_hash=spec.spec_hash) == [1.0]
    for cls in ("cpu", "H100"):
        for phase in PHASES:
            got = values(m, "bagel_step_seconds_total", worker_class=cls, phase=phase)
            assert got and sum(got) > 0, (cls, phase)
        thr = values(m, "bagel_denoising_samples_per_second", worker_class=cls)
        assert thr and all(10 < v < 1e4 for v in thr), (cls, thr)  # simulated at 100 samples/s
        assert sum(values(m, "bagel_trained_samples_total", worker_class=cls)) > 0
        assert values(m, "bagel_worker_memory_bytes", worker_class=cls, kind="rss_max") == [300 << 20]
        assert sum(values(m, "bagel_cost_total", worker_class=cls)) > 0
    assert values(m, "bagel_worker_memory_bytes", worker_class="H100", kind="cuda_free_min") == [8 << 30]
    assert values(m, "bagel_worker_memory_bytes", worker_class="H100", kind="cuda_peak_allocated_max") == [4 << 30]
    assert not values(m, "bagel_worker_memory_bytes", worker_class="cpu", kind="cuda_free_min")
    # queueing: every worker has a cell, every cell has members
    assert values(m, "bagel_standby_workers") == [0.0]
    assert values(m, "bagel_cells_without_members") == [0.0]
    for cell in cells:
        assert values(m, "bagel_round_open_to_freeze_seconds_count", cell=cell)[0] >= 2
        assert 0 < values(m, "bagel_round_open_to_freeze_seconds_sum", cell=cell)[0] < 60
        assert 0 < values(m, "bagel_exchange_p99_seconds", cell=cell)[0] < 1.0  # reduce_s = 0.02
        assert values(m, "bagel_rounds_attempted_total", cell=cell)[0] >= 2
        # every commit needed an ok report of the open round (min_replicas is a target, not a
        # floor: on a loaded machine a cell's first round can open with its first holder alone)
        assert values(m, "bagel_exchange_reports_total", cell=cell, outcome="ok")[0] >= committed[cell] >= 2
        ratio = values(m, "bagel_slo_round_success_ratio", cell=cell)[0]
        burn = values(m, "bagel_slo_burn_rate", cell=cell)[0]
        assert 0 < ratio <= 1 and burn == pytest.approx((1 - ratio) / (1 - 0.8))
        assert values(m, "bagel_heldout_loss", cell=cell) == [pytest.approx(0.3)]
        assert values(m, "bagel_loss_spikes_total", cell=cell) == [0.0]
        assert values(m, "bagel_rollbacks_total", cell=cell) == [0.0]
        assert values(m, "bagel_committed_samples", cell=cell)[0] >= 2 * spec.diloco.group_batch
        cps = values(m, "bagel_cost_per_committed_sample", cell=cell)[0]
        assert 0 < cps < 0.01, cps  # seconds of a 2.0/h and a 0.1/h device per few dozen samples
    assert values(m, "bagel_slo_round_success_objective") == [0.8]
    for method in ("Heartbeat", "ReportRound", "Register"):
        assert 0 < values(m, "bagel_rpc_latency_p99_seconds", method=method)[0] < 5.0


def _round(cell: str, rnd: int, members: list[str]) -> RoundRecord:
    plans = tuple(MemberPlan(w, PeerAddress("p", ()), 16, 1, 32) for w in sorted(members))
    return RoundRecord(cell, rnd, 1, RoundState.REDUCING, 0, 60_000, 2, plans, frozen_ms=2_000, reduce_attempt=1)


def _series_after(n_workers: int) -> tuple[int, str]:
    spec = parse_spec(cluster_spec_text(extra=EXTRA))
    metrics = Metrics()
    book = RunBook(spec, metrics, Snapshot((), (), (), ()), 0)
    ids = [f"worker-{i:04d}" for i in range(n_workers)]
    for cell in spec.cell_ids:
        rnd = _round(cell, 1, ids)
        book.records([rnd])
        for i, wid in enumerate(ids):
            # hostile device names: each worker claims a GPU of its own
            kind, name = ("cpu", "") if i % 3 == 0 else ("cuda", f"GPU-{wid}" if i % 3 == 1 else f"H100 #{i}")
            cls = worker_class(Profile(device_kind=kind, device_name=name), spec.cost)
            req = pb.ReportRoundRequest(cell_id=cell, round=1, state_hash="a" * 64, samples=32, reduce_attempt=1)
            req.data_ms, req.forward_backward_ms, req.exchange_ms, req.rss_bytes = 10, 100, 20 + i, 1 << 28
            req.cuda_free_bytes = 0 if kind == "cpu" else 1 << 33
            book.report(cls, 1, req, rnd, wid, 5_000)
        ended = RoundRecord(cell, 1, 1, RoundState.COMMITTED, 0, 60_000, 2, rnd.members, ended_ms=6_000)
        book.records([ended])
    for method in ("Heartbeat", "ReportRound"):
        for i in range(n_workers):
            metrics.observe_rpc(method, 0.001 * (1 + i % 7), "OK")
    book.publish(0, 0)
    text = metrics.text()
    series = sum(len(fam.samples) for fam in metrics.registry.collect())
    return series, text


def test_label_cardinality_is_bounded_with_1000_workers() -> None:
    few, _ = _series_after(9)
    many, text = _series_after(1000)
    assert many == few, (few, many)
    assert "worker-0" not in text
    spec = parse_spec(cluster_spec_text(extra=EXTRA))
    classes = {lab.split('"')[1] for lab in text.split("worker_class=")[1:]}
    assert classes == {"cpu", "H100", "other"}
    # a bound computed from the spec alone: cells x classes x phases dominates
    assert many < 40 * len(spec.cell_ids) * len(classes) + 400


def test_rollbacks_follow_the_cells_epoch() -> None:
    """A cell's record carries how often it fell back to its checkpoint; the gauge shows it
    (durable, so a restarted daemon shows the same count)."""
    spec = parse_spec(cluster_spec_text(extra=EXTRA))
    metrics = Metrics()
    book = RunBook(spec, metrics, Snapshot((), (), (), ()), 0)
    cell = spec.cell_ids[0]
    book.records([CellRecord(cell, 3, "a" * 64), CellRecord(cell, 2, "b" * 64, rollbacks=1)])
    got = {
        s.labels["cell"]: s.value
        for fam in text_string_to_metric_families(metrics.text())
        for s in fam.samples
        if s.name == "bagel_rollbacks_total"
    }
    assert got == {cell: 1.0}

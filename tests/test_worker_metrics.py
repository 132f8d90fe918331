"""The worker's round metrics: the trainer's split of its inner loop, the report fields
built from it, and the worker's own Prometheus endpoint (`--metrics-listen`)."""

from __future__ import annotations

import urllib.request

import torch

from bagel.models.data import shard
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.runspec import parse_spec
from bagel.protocol.validation import ValidationError, validate_report_round
from bagel.worker.metrics import WorkerMetrics, round_metrics, rss_bytes
from bagel.worker.roundwork import ReduceOutcome
from bagel.worker.trainer import InnerPlan, InnerTrainer, RoundKey, round_indices

from test_trainer import LinearTask

KEY = RoundKey("run", "k0.r0", 1, 0, 2)


def test_trainer_splits_its_time_and_the_report_carries_it() -> None:
    task = LinearTask()
    tr = InnerTrainer(task, task.build_model(), torch.device("cpu"), lr=0.05, throttle=2.0)
    plan = InnerPlan(inner_steps=4, micro_batch=8, grad_accum=2)
    res = tr.run(KEY, plan, round_indices(shard, KEY, tr.num_train, plan))
    assert res.data_s > 0 and res.forward_backward_s > 0 and res.optimizer_s > 0 and res.throttle_s > 0
    parts = res.data_s + res.forward_backward_s + res.optimizer_s + res.throttle_s
    assert parts <= res.compute_s * 1.01
    out = ReduceOutcome({}, "a" * 64, {}, 10, 10, comm_s=0.5, encode_s=0.1, outer_step_s=0.05)  # type: ignore[arg-type]
    fields = round_metrics(res, out, waiting_s=0.25, device=torch.device("cpu"))
    assert fields["encode_ms"] == 100 and fields["exchange_ms"] == 400 and fields["outer_step_ms"] == 50
    assert fields["waiting_ms"] >= 250 and fields["rss_bytes"] > 1 << 20
    assert "cuda_free_bytes" not in fields  # CPU: no device memory to report
    assert 1 << 20 < rss_bytes() < 1 << 40
    # the fields pass the coordinator's validation; hostile ones do not
    spec = parse_spec('[run]\nid = "r"\n')
    req = pb.ReportRoundRequest(cell_id="k0.r0", round=1, state_hash="a" * 64, samples=64, **fields)
    validate_report_round(req, spec)
    for name, bad in (("encode_ms", -1), ("rss_bytes", 1 << 60), ("waiting_ms", 10**12)):
        hostile = pb.ReportRoundRequest(cell_id="k0.r0", round=1, state_hash="a" * 64, **{name: bad})
        try:
            validate_report_round(hostile, spec)
        except ValidationError as e:
            assert e.field == name
        else:
            raise AssertionError(f"{name}={bad} passed validation")
    many = {k: 20 * 24 * 3600 * 1000 for k in ("data_ms", "forward_backward_ms")}  # each in range, 40 days together
    try:
        validate_report_round(pb.ReportRoundRequest(cell_id="k0.r0", round=1, state_hash="a" * 64, **many), spec)
    except ValidationError as e:
        assert "sum" in e.reason
    else:
        raise AssertionError("phases summing past the bound passed validation")


def test_worker_endpoint_serves_its_series() -> None:
    m = WorkerMetrics()
    port = m.serve("127.0.0.1", 0)
    try:
        m.set_run("r", "f" * 64)
        m.round({"data_ms": 100, "forward_backward_ms": 700, "optimizer_ms": 200, "rss_bytes": 5 << 20}, 64)
        m.moved("exchange", "sent", 1000)
        m.moved("checkpoint", "sent", 5000)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        m.stop()
    assert 'bagel_info{run_id="r",spec_hash="' + "f" * 64 in text
    assert 'bagel_worker_step_seconds_total{phase="forward_backward"} 0.7' in text
    assert "bagel_worker_denoising_samples_per_second 64.0" in text
    assert 'bagel_worker_bytes_total{direction="sent",kind="exchange"} 1000.0' in text
    assert 'bagel_worker_bytes_total{direction="sent",kind="checkpoint"} 5000.0' in text
    assert 'bagel_worker_memory_bytes{kind="rss"} 5.24288e+06' in text

"""`bench/gpu_check.py`'s CPU part, as a smoke test: it runs as a subprocess, writes its JSON
with every part measured, and says plainly that the GPU part is unverified."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def numbers(d: dict[str, Any], *keys: str) -> list[float]:
    out = []
    for k in keys:
        v = d[k]
        assert isinstance(v, int | float) and not isinstance(v, bool), (k, v)
        out.append(float(v))
    return out


@pytest.mark.timeout(180)
def test_the_cpu_part_measures_every_part_and_says_the_gpu_is_unverified(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # in-process exchange: the data plane's own tests cover hivemind; this keeps the smoke run short
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--exchange", "inprocess", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPU PART UNVERIFIED" in proc.stdout
    r = json.loads(out.read_text())
    assert r["bench"] == "gpu_check" and r["gpu_verified"] is False and "unverified" in r["note"]
    assert r["env"]["device"] == "cpu" and r["env"]["cuda_available"] in (True, False)

    fp32 = r["train"]["fp32"]
    assert fp32["status"] == "ok", fp32
    for v in numbers(fp32, "samples_per_s", "step_ms", "loss", "params", "warmup_s", "peak_rss_bytes"):
        assert math.isfinite(v) and v > 0
    # the scheduler's figure for the cell: at least its parameters' float32 weights, grads and moments
    est, data = numbers(fp32, "sched_estimate_bytes", "data_bytes")
    assert est > 4 * 4 * fp32["params"] and data > 0
    assert fp32["peak_mem_bytes"] is None and fp32["headroom_bytes"] is None  # CUDA memory: not on CPU
    for mode in ("bf16", "compile"):
        assert r["train"][mode]["status"] == "skipped" and r["train"][mode]["why"]

    d = r["diloco"]
    assert d["status"] == "ok", d
    assert d["members"] == 2 and d["replicas_identical"] is True and len(d["state_hash"]) == 64
    assert d["exchange"].startswith("in-process")
    for v in numbers(d, "train_s", "train_samples_per_s", "exchange_s", "round_s", "samples", "state_nbytes"):
        assert math.isfinite(v) and v > 0
    # int8 pseudo-gradients: far fewer bytes than the fp32 state
    assert len(d["bytes_per_member"]) == 2 and all(0 < b < d["state_nbytes"] / 2 for b in d["bytes_per_member"])
    assert d["samples"] == 2 * d["inner_steps"] * d["member_batch"]

    s = r["sampler"]
    assert s["status"] == "ok", s
    assert len(s["cells"]) == 5 and s["fp32"]["status"] == "ok" and s["bf16"]["status"] == "skipped"
    for v in numbers(s["fp32"], "samples_per_s", "ms_per_step", "sample_s"):
        assert math.isfinite(v) and v > 0
    assert r["wall_s"] > 0

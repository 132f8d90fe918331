"""`bagel-coordinator status --json`: one schema from `--data-dir` and `--target`.

A real coordinator on port 0 with simulated workers commits a few rounds of some cells and
none of others; once the workers are gone and the state stands still, both sources are
read through the command line itself. Every key is present in both, with the same type,
and the same value, except the volatile ones only a live daemon knows (null from the store)
and the round history only the store has (null from the daemon). Untrained cells are null
where a number would lie, and the table shows "—" for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from bagel.coordinator import cli
from bagel.coordinator.core.records import WorkerState
from bagel.coordinator.daemon import start_coordinator
from bagel.coordinator.statusdoc import STORE_ONLY_KEYS, VOLATILE_CELL_KEYS, VOLATILE_WORKER_KEYS, eta_s
from bagel.protocol.runspec import parse_spec

from simworkers import cluster_spec_text, start_workers, stop_workers, uniform_cells
from test_cluster import wait_for

TOP_VOLATILE = ("source", "now_unix_ms", "uptime_s")


def run_status(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["status", *args])
    return code, out.getvalue()


def assert_same_types(a: Any, b: Any, where: str) -> None:
    """Same keys and JSON types, recursively; null matches anything (a source may not know)."""
    if a is None or b is None:
        return
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        assert type(a) is type(b), (where, a, b)
        return
    assert type(a) is type(b), (where, a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a.keys() ^ b.keys()))
        for k in a:
            assert_same_types(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_same_types(x, y, f"{where}[{i}]")


@pytest.mark.timeout(90)
async def test_data_dir_and_target_agree(tmp_path: Path) -> None:
    # one cluster's cells train (min_replicas 2 and 3 workers: only some cells get members)
    spec = parse_spec(cluster_spec_text(min_replicas=3, extra="[slo]\ncell_sample_target = 100000\n"))
    h = await start_coordinator(
        spec, tmp_path / "coord", listen="127.0.0.1:0", cells=uniform_cells(spec.cell_ids), tick_ms=50
    )
    workers = await start_workers(f"127.0.0.1:{h.port}", spec.run.id, 3, cells=spec.cell_ids)
    try:
        await wait_for(
            lambda: any(c.committed_round >= 3 for c in h.state.snapshot().cells), 60, "3 commits in some cell"
        )
        key = str(h.data_dir / "coordinator.key")
        target = f"127.0.0.1:{h.port}"
        code, out = await asyncio.to_thread(run_status, "--target", target, "--insecure", "--key", key, "--json")
        running = json.loads(out)
        assert code == 0 and len(running["workers"]) == 3
        for w in running["workers"]:  # while they run: a phase word and a fresh heartbeat
            assert w["phase"] in ("idle", "syncing", "training", "ready", "reducing"), w["phase"]
            assert 0 <= w["heartbeat_age_s"] < spec.schedule.lease_s
            assert w["lease_expires_unix_ms"] > running["now_unix_ms"] - 1000
        for w in workers:
            await w.crash()  # no Leave: their leases run out, and then nothing changes any more
        await wait_for(
            lambda: all(w.state is not WorkerState.ACTIVE for w in h.state.snapshot().workers), 30, "leases lapse"
        )
        await asyncio.sleep(0.7)  # past the status cache (security.status_cache_ms = 500)
        code_t, out_t = await asyncio.to_thread(run_status, "--target", target, "--insecure", "--key", key, "--json")
        code_s, out_s = await asyncio.to_thread(run_status, "--data-dir", str(h.data_dir), "--json")
        code_table, table = await asyncio.to_thread(run_status, "--data-dir", str(h.data_dir))
    finally:
        await stop_workers(workers)
        await h.stop()
    assert code_t == code_s == code_table == 0
    live, stored = json.loads(out_t), json.loads(out_s)
    assert_same_types(live, stored, "doc")

    # the same values wherever both sources know them
    for k in live:
        if k not in TOP_VOLATILE and k not in STORE_ONLY_KEYS and k not in ("workers", "cells"):
            assert live[k] == stored[k], k
    assert live["started_unix_ms"] == stored["started_unix_ms"] and live["uptime_s"] > 0
    assert stored["rounds"] and stored["checkpoints"] is not None and live["rounds"] is None
    assert [w["worker_id"] for w in live["workers"]] == [w["worker_id"] for w in stored["workers"]]
    for lw, sw in zip(live["workers"], stored["workers"], strict=True):
        for k in VOLATILE_WORKER_KEYS:
            assert sw[k] is None, k
        assert {k: v for k, v in lw.items() if k not in VOLATILE_WORKER_KEYS} == {
            k: v for k, v in sw.items() if k not in VOLATILE_WORKER_KEYS
        }
    assert [c["cell_id"] for c in live["cells"]] == list(spec.cell_ids) == [c["cell_id"] for c in stored["cells"]]
    for lc, sc in zip(live["cells"], stored["cells"], strict=True):
        for k in VOLATILE_CELL_KEYS:
            assert sc[k] is None and isinstance(lc[k], float), k
        same = {k: v for k, v in lc.items() if k not in VOLATILE_CELL_KEYS}
        assert same == {k: v for k, v in sc.items() if k not in VOLATILE_CELL_KEYS}, lc["cell_id"]

    # numbers are numbers, phases words, untrained cells null
    trained = [c for c in stored["cells"] if c["trained"]]
    untrained = [c for c in stored["cells"] if not c["trained"]]
    assert trained and untrained, [c["committed_round"] for c in stored["cells"]]
    for c in trained:
        assert isinstance(c["committed_round"], int) and c["committed_round"] >= 1
        assert isinstance(c["last_loss"], float) and c["last_commit_unix_ms"] > 0
        if c["committed_round"] >= 2:
            assert c["samples_per_s"] > 0 and c["eta_s"] > 0 and c["sample_target"] == 100000
    for c in untrained:
        assert c["last_loss"] is None and c["latest_checkpoint_round"] is None and c["eta_s"] is None
        assert c["last_commit_unix_ms"] is None and c["committed_round"] == 0
    assert all(w["phase"] is None for w in live["workers"])  # none active any more
    assert "PHASE_" not in out_t and "0.0000" not in table and "—" in table


def test_eta() -> None:
    assert eta_s(100, 0, 5.0) is None  # no target
    assert eta_s(100, 1000, 0.0) is None  # no rate yet
    assert eta_s(100, 1000, 9.0) == pytest.approx(100.0)
    assert eta_s(2000, 1000, 9.0) == 0.0

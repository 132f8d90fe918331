"""Data to volunteers: a worker without the dataset fetches its cell's shards from a real
coordinator (in-process, gRPC on port 0): exactly the cell's data, bit-identical to what
`models/data.py` gives locally; only the cell's shards cross the wire; a partial download
resumes from where it stopped; a tampered shard (on the coordinator's disk, or in the
worker's cache) is refused, never installed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from bagel.coordinator.daemon import start_coordinator
from bagel.models import datashards
from bagel.models.experts import cell_task
from bagel.protocol.runspec import parse_spec
from bagel.worker.datafetch import DataFetcher, DataFetchError, needs_fetch
from bagel.worker.display import Display

from simworkers import cluster_spec_text, start_workers, stop_workers, uniform_cells


def _local(spec, cell: str) -> tuple[torch.Tensor, ...]:
    task = cell_task(spec, cell)
    x, y = task.train_data()
    xh, yh = task.heldout_data()
    n = spec.guard.eval_samples
    return x, y, xh[:n], yh[:n]


@pytest.mark.timeout(90)
async def test_a_worker_fetches_only_its_cells_shards_resumes_and_refuses_tampering(tmp_path: Path) -> None:
    spec = parse_spec(cluster_spec_text(lease_s=30.0))
    assert not needs_fetch(spec, "auto")  # digits ship with scikit-learn: nobody fetches them
    datashards.uninstall_all()
    want = {c: _local(spec, c) for c in ("k0.r0", "router")}
    h = await start_coordinator(spec, tmp_path / "c", cells=uniform_cells(spec.cell_ids), tick_ms=50)
    workers = await start_workers(f"127.0.0.1:{h.port}", spec.run.id, 1, cells=spec.cell_ids)
    client = workers[0].client
    display = Display("quiet")
    try:
        for _ in range(200):  # registered (data RPCs answer registered workers only)
            if h.app.is_joined(client.worker_id):
                break
            await asyncio.sleep(0.05)
        fetcher = DataFetcher(tmp_path / "w1", lambda: client, display)
        await fetcher.ensure(spec, "k0.r0")
        got = datashards.installed(spec, "k0.r0")
        assert got is not None
        for a, b in zip((got.x_train, got.y_train, got.x_heldout, got.y_heldout), want["k0.r0"], strict=True):
            assert torch.equal(a, b)
        assert cell_task(spec, "k0.r0").train_data()[0] is got.x_train  # the task reads the fetched data

        # only cluster 0's training shards and its held-out shard crossed the wire
        store = h.datashards
        assert store is not None
        refs = await store.refs()
        mine = await store.manifest("k0.r0")
        assert {s.split for s in mine.shards} == {"train", "heldout"}
        assert all(s.cluster == 0 for s in mine.shards)
        assert fetcher.fetched_bytes == sum(s.nbytes for s in mine.shards)
        assert fetcher.fetched_bytes < sum(r.nbytes for r in refs.values()) * 0.75
        assert sorted(p.name for p in (tmp_path / "w1").iterdir()) == sorted(s.sha256 for s in mine.shards)

        # the router classifies among every cluster: its data is the whole training split
        datashards.uninstall_all()
        await DataFetcher(tmp_path / "w1", lambda: client, display).ensure(spec, "router")
        r = datashards.installed(spec, "router")
        assert r is not None and torch.equal(r.x_train, want["router"][0]) and torch.equal(r.y_train, want["router"][1])

        # resume: half a shard on disk, only the rest is fetched
        datashards.uninstall_all()
        first = mine.shards[0]
        blob = (h.data_dir / "datashards" / first.sha256).read_bytes()
        root = tmp_path / "w2"
        root.mkdir()
        (root / f"{first.sha256}.part").write_bytes(blob[: len(blob) // 2])
        resumed = DataFetcher(root, lambda: client, display)
        await resumed.ensure(spec, "k0.r0")
        assert resumed.fetched_bytes == sum(s.nbytes for s in mine.shards) - len(blob) // 2
        assert (root / first.sha256).read_bytes() == blob

        # a cached shard damaged on the worker's disk is refused and fetched again
        datashards.uninstall_all()
        cached = root / first.sha256
        cached.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
        again = DataFetcher(root, lambda: client, display)
        await again.ensure(spec, "k0.r0")
        assert cached.read_bytes() == blob and again.fetched_bytes == len(blob)

        # a shard tampered with on the coordinator's disk is refused: nothing installed or kept
        datashards.uninstall_all()
        served = h.data_dir / "datashards" / first.sha256
        served.write_bytes(blob[:100] + bytes([blob[100] ^ 0xFF]) + blob[101:])
        victim = DataFetcher(tmp_path / "w3", lambda: client, display)
        with pytest.raises(DataFetchError, match="do not hash to its name"):
            await victim.ensure(spec, "k0.r0")
        assert datashards.installed(spec, "k0.r0") is None
        assert not (tmp_path / "w3" / first.sha256).exists()
        assert not (tmp_path / "w3" / f"{first.sha256}.part").exists()
        with pytest.raises(DataFetchError):  # and it backs off instead of hammering the coordinator
            await victim.ensure(spec, "k0.r0")
    finally:
        datashards.uninstall_all()
        await stop_workers(workers)
        await h.stop()


def test_one_shard_stream_per_worker_and_a_stale_release_frees_nothing() -> None:
    from bagel.coordinator.admission import Admission, ShardStreamBusy

    adm = Admission(parse_spec(cluster_spec_text()))
    first = adm.take_shard_slot("w1")
    with pytest.raises(ShardStreamBusy, match="one at a time"):
        adm.take_shard_slot("w1")
    adm.release_shard_slot("w1", first)  # the deadline gave it back
    second = adm.take_shard_slot("w1")
    adm.release_shard_slot("w1", first)  # the first stream ends late: the second keeps its slot
    with pytest.raises(ShardStreamBusy):
        adm.take_shard_slot("w1")
    adm.release_shard_slot("w1", second)
    adm.take_shard_slot("w1")


@pytest.mark.timeout(60)
async def test_a_local_copy_is_checked_against_the_coordinators_partition(tmp_path: Path) -> None:
    from bagel.models.data import cluster_manifest

    spec = parse_spec(cluster_spec_text(lease_s=30.0))
    h = await start_coordinator(spec, tmp_path / "c", cells=uniform_cells(spec.cell_ids), tick_ms=50)
    workers = await start_workers(f"127.0.0.1:{h.port}", spec.run.id, 1, cells=spec.cell_ids)
    client = workers[0].client
    try:
        for _ in range(200):
            if h.app.is_joined(client.worker_id):
                break
            await asyncio.sleep(0.05)
        f = DataFetcher(tmp_path / "w", lambda: client, Display("quiet"))
        assert await f.same_partition("k1.r0", cluster_manifest(spec).sha256) is True
        assert await f.same_partition("k1.r0", "0" * 64) is False  # other files at the same path
        assert await DataFetcher(tmp_path / "w", lambda: None, Display("quiet")).same_partition("k1.r0", "") is None
        assert not (h.data_dir / "datashards").exists()  # checking a copy builds no shard
    finally:
        await stop_workers(workers)
        await h.stop()


def test_auto_fetches_only_where_there_is_no_local_copy(tmp_path: Path) -> None:
    base = parse_spec(cluster_spec_text())
    folder = tmp_path / "imgs"

    def spec(source: str, path: Path):  # noqa: ANN202
        text = cluster_spec_text().replace('source = "digits"', f'source = "{source}"\npath = "{path}"')
        return parse_spec(text)

    assert not needs_fetch(base, "auto") and needs_fetch(base, "always")
    assert needs_fetch(spec("folder", folder), "auto")  # missing
    folder.mkdir()
    assert needs_fetch(spec("folder", folder), "auto")  # empty
    (folder / "a.png").write_bytes(b"")
    assert not needs_fetch(spec("folder", folder), "auto")
    assert not needs_fetch(spec("folder", tmp_path / "nope"), "never")
    assert needs_fetch(spec("npy", tmp_path), "auto")
    (tmp_path / "images.npy").write_bytes(b"")
    assert not needs_fetch(spec("npy", tmp_path), "auto")

"""Checkpoints over gRPC: a committed contributor asked to upload streams real safetensors
bytes; the coordinator verifies size, sha256 and the state hash before the file becomes
visible, and other workers download it (1 MiB chunks, CheckpointInfo first).
A stream longer than declared is refused with RESOURCE_EXHAUSTED, a file whose bytes or
tensors do not match with INVALID_ARGUMENT, and neither leaves anything behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from bagel.coordinator.daemon import start_coordinator
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.envelope import sign_request
from bagel.protocol.messages import Instruction
from bagel.protocol.runspec import parse_spec
from bagel.protocol.statehash import state_hash

from simworkers import SimWorker, cluster_spec_text, sim_schema, start_workers, stop_workers, uniform_cells

ONE_CELL = {
    "clusters = 2": "clusters = 1",
    "timestep_ranges = 2": "timestep_ranges = 1",
    "router = true": "router = false",
}


def one_cell_spec(**kw) -> str:
    text = cluster_spec_text(**kw)
    for a, b in ONE_CELL.items():
        text = text.replace(a, b)
    return text


async def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


@pytest.mark.timeout(90)
async def test_workers_upload_and_download_checkpoints(tmp_path: Path) -> None:
    spec = parse_spec(one_cell_spec(every_rounds=1, min_replicas=1))
    h = await start_coordinator(
        spec, tmp_path / "c", cells=uniform_cells(spec.cell_ids), tick_ms=50, checkpoint_schema=sim_schema
    )
    workers = await start_workers(f"127.0.0.1:{h.port}", spec.run.id, 3, cells=spec.cell_ids)
    try:
        await wait_for(lambda: sum(len(w.stats.uploads) for w in workers) >= 3, 60, "three stored checkpoints")
        cell = h.state.snapshot().cells[0]
        assert cell.checkpoint_round >= 1
        metas = h.app.checkpoints.list("k0.r0")
        assert 1 <= len(metas) <= spec.checkpoint.keep  # retention
        info, data = await workers[0].client.download_checkpoint("k0.r0")
        assert info.round == max(m.round for m in metas)
        assert info.state_hash == h.state.committed_hash_of("k0.r0", info.round) or info.state_hash == state_hash(
            load_safetensors(data)
        )
        assert state_hash(load_safetensors(data)) == info.state_hash
        assert hashlib.sha256(data).hexdigest() == info.sha256
    finally:
        await stop_workers(workers)
        await h.stop()


@pytest.mark.timeout(90)
async def test_bad_uploads_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    spec = parse_spec(one_cell_spec(every_rounds=1, min_replicas=1, lease_s=60.0))
    h = await start_coordinator(
        spec, tmp_path / "c", cells=uniform_cells(spec.cell_ids), tick_ms=50, checkpoint_schema=sim_schema
    )
    workers = await start_workers(f"127.0.0.1:{h.port}", spec.run.id, 3, cells=spec.cell_ids, upload=False)
    try:
        await wait_for(lambda: any(w.instruction.upload_checkpoint for w in workers), 60, "an upload request")
        # freeze the cluster, so the request stays what it is
        for w in workers:
            await w.crash()

        # the request as the core holds it once they stopped: the instruction a worker heard
        # last may be stale (seen in a fresh-clone run: a round committed while the others
        # were still being stopped, the request moved on, and the upload was taken for one
        # stored already)
        def wanted() -> tuple[SimWorker, Instruction] | None:
            for w in workers:
                ins = h.state.instruction_for(w.worker_id)
                if ins.upload_checkpoint and (ins.cell_id, ins.committed_round) in w.states:
                    return w, ins
            return None

        await wait_for(lambda: wanted() is not None, 30, "the core's upload request")
        found = wanted()
        assert found is not None
        uploader, ins = found
        cell, rnd, committed = ins.cell_id, ins.committed_round, ins.committed_hash
        tensors = uploader.states[(cell, rnd)]
        good = save_safetensors(tensors)
        assert state_hash(tensors) == committed

        async def upload(declared: bytes, sent: bytes, hash_in_header: str = committed) -> pb.UploadCheckpointResponse:
            header = pb.UploadCheckpointHeader(
                cell_id=cell,
                round=rnd,
                state_hash=hash_in_header,
                total_bytes=len(declared),
                sha256=hashlib.sha256(declared).hexdigest(),
            )
            signed = sign_request(uploader.identity, header, run_id=spec.run.id, method="UploadCheckpoint")

            async def chunks() -> AsyncIterator[pb.CheckpointUploadChunk]:
                yield pb.CheckpointUploadChunk(header=signed)
                for i in range(0, len(sent), 64):
                    yield pb.CheckpointUploadChunk(data=sent[i : i + 64])

            return await uploader.client._stub.UploadCheckpoint(chunks(), timeout=10)

        other = {**tensors, "w.p": tensors["w.p"] + 1}
        cases = [
            ("stream longer than declared", grpc.StatusCode.RESOURCE_EXHAUSTED, good, good + b"x" * 100),
            ("bytes differ from the declared sha256", grpc.StatusCode.INVALID_ARGUMENT, good, good[:-1] + b"\0"),
            ("not a safetensors file", grpc.StatusCode.INVALID_ARGUMENT, b"x" * 200, b"x" * 200),
            (
                "tensors of another state",
                grpc.StatusCode.INVALID_ARGUMENT,
                save_safetensors(other),
                save_safetensors(other),
            ),
        ]
        for name, code, declared, sent in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await upload(declared, sent)
            assert err.value.code() == code, (name, err.value.details())
            assert h.app.checkpoints.list() == [], name
            assert [p for p in (h.data_dir / "checkpoints").rglob("*") if p.is_file()] == [], name
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a hash that was never committed
            await upload(good, good, hash_in_header="0" * 64)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # and the honest upload goes through
        resp = await upload(good, good)
        assert resp.stored and resp.round == rnd
        assert [m.round for m in h.app.checkpoints.list(cell)] == [rnd]
        assert h.state.snapshot().cells[0].checkpoint_round == rnd
    finally:
        await stop_workers(workers)
        await h.stop()


@pytest.mark.timeout(90)
async def test_a_committed_state_that_is_not_the_cells_model_is_not_stored(tmp_path: Path) -> None:
    """The simulated workers commit a stand-in state (two 32-element tensors): its hash is the
    committed one, but it is not the cell's model as the run spec builds it, so the
    coordinator (checking against the real model, the daemon's default) stores nothing."""
    spec = parse_spec(one_cell_spec(every_rounds=1, min_replicas=1))
    h = await start_coordinator(spec, tmp_path / "c", cells=uniform_cells(spec.cell_ids), tick_ms=50)
    workers = await start_workers(f"127.0.0.1:{h.port}", spec.run.id, 2, cells=spec.cell_ids)
    try:
        errors = lambda: [e for w in workers for e in w.stats.errors if e.startswith("upload")]  # noqa: E731
        refused = lambda: [e for e in errors() if "INVALID_ARGUMENT" in e and "not this cell's model" in e]  # noqa: E731
        await wait_for(lambda: len(refused()) >= 2, 60, "two refused uploads")
        # a retry that races the server's release of the refused upload's slot is told to wait
        assert all(e in refused() or "one at a time" in e for e in errors()), errors()
        assert not any(w.stats.uploads for w in workers)
        assert h.app.checkpoints.list() == []
        assert [p for p in (h.data_dir / "checkpoints").rglob("*") if p.is_file()] == []
        assert h.state.snapshot().cells[0].checkpoint_round < 1  # none stored
    finally:
        await stop_workers(workers)
        await h.stop()

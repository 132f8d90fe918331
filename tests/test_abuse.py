"""Resource abuse against a real coordinator: idle upload streams, concurrent uploads by
one uploader, oversized declarations, a GetStatus flood. Each test ends with a real
Heartbeat answered OK: the coordinator still serves its workers (the latency before and
after is measured by bench/abuse.py, not asserted here).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from safetensors.numpy import save as save_safetensors

from bagel.coordinator.daemon import CoordinatorHandle, start_coordinator
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.envelope import sign_request
from bagel.protocol.identity import Identity
from bagel.protocol.runspec import parse_spec

from simworkers import (
    SimWorker,
    cluster_spec_text,
    fake_peer_id,
    sim_schema,
    start_workers,
    stop_workers,
    uniform_cells,
)

ONE_CELL = {
    "clusters = 2": "clusters = 1",
    "timestep_ranges = 2": "timestep_ranges = 1",
    "router = true": "router = false",
}
PROFILE = pb.WorkerProfile(name="probe", device_kind="cpu", vram_bytes=8 << 30, num_devices=1)


def spec_text(security: str) -> str:
    text = cluster_spec_text("abuse", every_rounds=1, min_replicas=1, lease_s=60.0, extra=f"[security]\n{security}")
    for a, b in ONE_CELL.items():
        text = text.replace(a, b)
    return text


async def wait_for(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


async def heartbeat_ok(h: CoordinatorHandle) -> None:
    """A fresh worker registers and its heartbeat is answered OK."""
    async with CoordinatorClient(f"127.0.0.1:{h.port}", Identity.generate(), h.spec.run.id) as c:
        await c.register(PROFILE, pb.PeerAddress(peer_id=fake_peer_id("probe"), maddrs=["/ip4/127.0.0.1/tcp/1"]))
        resp = await c.heartbeat(pb.PHASE_IDLE)
        assert resp.lease_expires_unix_ms > 0


class Uploader:
    """A worker the coordinator asked for a checkpoint, with the cluster frozen around it."""

    def __init__(self, h: CoordinatorHandle, w: SimWorker) -> None:
        self.h, self.w = h, w
        ins = w.instruction
        self.cell, self.round = ins.cell_id, ins.committed_round
        self.blob = save_safetensors(w.states[(self.cell, self.round)])
        self.hash = ins.committed_hash
        self.stub = w.client._stub

    def header(self, total: int | None = None) -> pb.CheckpointUploadChunk:
        total = len(self.blob) if total is None else total
        header = pb.UploadCheckpointHeader(
            cell_id=self.cell,
            round=self.round,
            state_hash=self.hash,
            total_bytes=total,
            sha256=hashlib.sha256(self.blob).hexdigest(),
        )
        signed = sign_request(self.w.identity, header, run_id=self.h.spec.run.id, method="UploadCheckpoint")
        return pb.CheckpointUploadChunk(header=signed)


async def frozen_uploader(h: CoordinatorHandle) -> tuple[Uploader, list[SimWorker]]:
    workers = await start_workers(f"127.0.0.1:{h.port}", h.spec.run.id, 2, cells=h.spec.cell_ids, upload=False)
    await wait_for(lambda: any(w.instruction.upload_checkpoint for w in workers), 60, "an upload request")
    w = next(w for w in workers if w.instruction.upload_checkpoint)
    for x in workers:
        await x.crash()  # the request stays what it is
    return Uploader(h, w), workers


async def start(tmp_path: Path, security: str) -> CoordinatorHandle:
    spec = parse_spec(spec_text(security))
    return await start_coordinator(
        spec, tmp_path / "c", cells=uniform_cells(spec.cell_ids), tick_ms=50, checkpoint_schema=sim_schema
    )


async def code_of(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(120)
async def test_idle_upload_streams_are_closed_at_their_deadline(tmp_path: Path) -> None:
    h = await start(tmp_path, "upload_idle_s = 0.5\npow_bits = 4")
    up, workers = await frozen_uploader(h)
    try:
        never = asyncio.Event()  # never set: the streams send nothing more

        async def silent() -> AsyncIterator[pb.CheckpointUploadChunk]:
            await never.wait()
            yield pb.CheckpointUploadChunk()  # pragma: no cover

        async def header_then_silent() -> AsyncIterator[pb.CheckpointUploadChunk]:
            yield up.header()
            yield pb.CheckpointUploadChunk(data=up.blob[:10])
            await never.wait()

        # 50 streams that never send a byte, and the requested uploader's own stream that
        # stops after its header: all closed by the coordinator, none by the client's timeout
        calls = [code_of(up.stub.UploadCheckpoint(silent(), timeout=30)) for _ in range(50)]
        calls.append(code_of(up.stub.UploadCheckpoint(header_then_silent(), timeout=30)))
        codes = await asyncio.gather(*calls)
        assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 51
        assert h.app.admission.uploads == 0, "an idle upload kept its slot"
        assert h.app.checkpoints.list() == []
        assert [p for p in (h.data_dir / "checkpoints").rglob("*") if p.is_file()] == []
        await heartbeat_ok(h)
    finally:
        await stop_workers(workers)
        await h.stop()


@pytest.mark.timeout(120)
async def test_a_second_concurrent_upload_is_refused(tmp_path: Path) -> None:
    h = await start(tmp_path, "pow_bits = 4")
    up, workers = await frozen_uploader(h)
    try:
        gate = asyncio.Event()

        async def held() -> AsyncIterator[pb.CheckpointUploadChunk]:
            yield up.header()
            yield pb.CheckpointUploadChunk(data=up.blob[:16])
            await gate.wait()
            yield pb.CheckpointUploadChunk(data=up.blob[16:])

        async def whole() -> AsyncIterator[pb.CheckpointUploadChunk]:
            yield up.header()
            yield pb.CheckpointUploadChunk(data=up.blob)

        first = asyncio.ensure_future(up.stub.UploadCheckpoint(held(), timeout=30))
        await wait_for(lambda: h.app.admission.uploads == 1, 10, "the first upload in progress")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await up.stub.UploadCheckpoint(whole(), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "one at a time" in (err.value.details() or "")
        gate.set()
        resp = await first  # the first upload is unharmed
        assert resp.stored and resp.round == up.round
        assert [m.round for m in h.app.checkpoints.list(up.cell)] == [up.round]
        assert h.app.admission.uploads == 0
        await heartbeat_ok(h)
    finally:
        await stop_workers(workers)
        await h.stop()


@pytest.mark.timeout(120)
async def test_a_declared_size_past_the_cells_checkpoint_is_refused_before_any_byte(tmp_path: Path) -> None:
    h = await start(tmp_path, "pow_bits = 4")
    up, workers = await frozen_uploader(h)
    try:
        sent = 0

        async def chunks() -> AsyncIterator[pb.CheckpointUploadChunk]:
            nonlocal sent
            yield up.header(total=1 << 30)  # 1 GiB: under checkpoint.max_bytes, far over the cell's size
            for _ in range(4):
                sent += 1
                yield pb.CheckpointUploadChunk(data=b"\0" * 1024)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await up.stub.UploadCheckpoint(chunks(), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most" in (err.value.details() or "")
        assert h.app.admission.uploads == 0
        assert [p for p in (h.data_dir / "checkpoints").rglob("*") if p.is_file()] == []
        await heartbeat_ok(h)
    finally:
        await stop_workers(workers)
        await h.stop()


@pytest.mark.timeout(120)
async def test_a_get_status_flood_is_answered_from_cache_or_refused(tmp_path: Path) -> None:
    h = await start(tmp_path, "pow_bits = 4\nstatus_rate_per_s = 5.0\nstatus_burst = 20\nstatus_cache_ms = 1000")
    workers = await start_workers(f"127.0.0.1:{h.port}", h.spec.run.id, 3, cells=h.spec.cell_ids)
    await wait_for(lambda: h.app.tally.counts().get("active", 0) >= 3, 60, "3 active workers")
    computed = 0
    real_status = h.app.status

    def counting_status(*, detailed: bool = True) -> pb.StatusResponse:
        nonlocal computed
        computed += 1
        return real_status(detailed=detailed)

    h.app.status = counting_status  # type: ignore[method-assign]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.port}") as ch:
            stub = pb_grpc.CoordinatorStub(ch)

            async def one() -> tuple[grpc.StatusCode, Any]:
                try:
                    return grpc.StatusCode.OK, await stub.GetStatus(pb.GetStatusRequest(), timeout=30)
                except grpc.aio.AioRpcError as e:
                    retry = dict(e.trailing_metadata() or ()).get("bagel-retry-after-ms")
                    return e.code(), retry

            results = await asyncio.gather(*(one() for _ in range(400)))
        ok = [r for code, r in results if code == grpc.StatusCode.OK]
        refused = [r for code, r in results if code != grpc.StatusCode.OK]
        assert {code for code, _ in results} <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert refused, "a flood of 400 from one address past a burst of 20 was never refused"
        assert all(r is not None and int(r) > 0 for r in refused), "a refusal without a retry hint"
        assert len(ok) >= 20  # the burst is served
        assert computed < len(ok), f"{computed} computations for {len(ok)} answers: not served from the cache"
        # the public view: cells and counts, no worker details
        assert all(not r.detailed and not r.workers and all(not c.members for c in r.cells) for r in ok)
        assert ok[-1].worker_counts["active"] >= 3
        # an active worker's signed request sees every worker
        detailed = await workers[0].client.status()
        assert detailed.detailed and len(detailed.workers) >= 3
        await heartbeat_ok(h)
    finally:
        await stop_workers(workers)
        await h.stop()

"""The in-process coordinator's lifecycle: graceful stop (health NOT_SERVING first, store
flushed), restart from the same data dir, an unexpected exception (INTERNAL, logged, the
daemon keeps serving), and a failing store (the shell stops taking requests instead of
acknowledging changes it could not make durable)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bagel.coordinator.core.records import WorkerState
from bagel.coordinator.daemon import DataDirLocked, start_coordinator
from bagel.coordinator.store import SpecMismatchError
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.identity import Identity
from bagel.protocol.runspec import parse_spec

from simworkers import cluster_spec_text, fake_peer_id, uniform_cells

PROFILE = pb.WorkerProfile(name="lc", device_kind="cpu", vram_bytes=8 << 30, num_devices=1)


def peer(seed: str) -> pb.PeerAddress:
    return pb.PeerAddress(peer_id=fake_peer_id(seed), maddrs=["/ip4/127.0.0.1/tcp/1"])


async def start(tmp_path: Path, text: str | None = None):
    spec = parse_spec(text or cluster_spec_text("lcrun", lease_s=30.0))
    return await start_coordinator(spec, tmp_path / "d", cells=uniform_cells(spec.cell_ids), tick_ms=50)


@pytest.mark.timeout(60)
async def test_graceful_stop_then_restart_restores(tmp_path: Path) -> None:
    h = await start(tmp_path)
    target = f"127.0.0.1:{h.port}"
    ids = [Identity.generate() for _ in range(3)]
    for i, ident in enumerate(ids):
        async with CoordinatorClient(target, ident, "lcrun") as c:
            await c.register(PROFILE, peer(str(i)))
    seen: list[int] = []
    async with grpc.aio.insecure_channel(target) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))

        async def follow() -> None:
            try:
                async for resp in watch:
                    seen.append(resp.status)
            except grpc.aio.AioRpcError:
                pass  # the server went away after announcing NOT_SERVING

        follower = asyncio.create_task(follow())
        while not seen:
            await asyncio.sleep(0.01)
        with pytest.raises(DataDirLocked):
            await start(tmp_path)  # a second coordinator on the same data dir
        await h.stop(grace_s=2.0)
        await asyncio.wait_for(follower, 10)
    assert seen[0] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen

    with pytest.raises(SpecMismatchError):  # the data dir belongs to this run's spec
        await start(tmp_path, cluster_spec_text("lcrun", lease_s=31.0))
    h2 = await start(tmp_path)
    try:
        restored = {w.worker_id: w for w in h2.state.snapshot().workers}
        assert set(restored) == {i.worker_id for i in ids}
        assert all(w.state is WorkerState.ACTIVE for w in restored.values())
        async with CoordinatorClient(f"127.0.0.1:{h2.port}", ids[0], "lcrun") as c:
            hb = await c.heartbeat(pb.PHASE_IDLE)  # re-attaches without re-registering
            assert hb.lease_expires_unix_ms > 0
        assert h2.identity.public_key == h.identity.public_key  # the key persisted
    finally:
        await h2.stop()


@pytest.mark.timeout(60)
async def test_unexpected_exception_is_internal_and_serving_continues(tmp_path: Path, monkeypatch, caplog) -> None:
    h = await start(tmp_path)
    try:
        async with CoordinatorClient(f"127.0.0.1:{h.port}", Identity.generate(), "lcrun") as c:
            await c.register(PROFILE, peer("a"))
            real = h.state.apply
            calls = {"n": 0}

            def flaky(now_ms, event):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise RuntimeError("boom")
                return real(now_ms, event)

            monkeypatch.setattr(h.state, "apply", flaky)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.heartbeat(pb.PHASE_IDLE)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "boom" not in (err.value.details() or "")  # no internals leak to clients
            assert "RuntimeError: boom" in caplog.text  # but the traceback is logged
            await c.heartbeat(pb.PHASE_IDLE)
    finally:
        await h.stop()


@pytest.mark.timeout(60)
async def test_store_failure_stops_acknowledging(tmp_path: Path, monkeypatch) -> None:
    h = await start(tmp_path)
    try:

        def broken(batches):
            raise OSError("disk full")

        monkeypatch.setattr(h.store, "write_many", broken)
        async with CoordinatorClient(f"127.0.0.1:{h.port}", Identity.generate(), "lcrun") as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.register(PROFILE, peer("b"))  # a durable change: it cannot be acknowledged
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert h.fatal.is_set()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.heartbeat(pb.PHASE_IDLE)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await h.stop()


@pytest.mark.timeout(60)
async def test_reflection_lists_the_services(tmp_path: Path) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    h = await start(tmp_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.port}") as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)

            async def ask():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            names = set()
            async for resp in stub.ServerReflectionInfo(ask()):
                names |= {s.name for s in resp.list_services_response.service}
        assert {"bagel.v1.Coordinator", "grpc.health.v1.Health"} <= names
    finally:
        await h.stop()


@pytest.mark.timeout(60)
async def test_loop_lag_is_measured_by_the_tick_loop(tmp_path: Path) -> None:
    h = await start(tmp_path)  # tick every 50 ms
    try:
        while "bagel_event_loop_lag_seconds_count 0.0" in h.metrics.text():
            await asyncio.sleep(0.05)
    finally:
        await h.stop()


def test_daemon_gc_policy_and_pause_metric() -> None:
    """The daemon freezes its start-up heap, turns automatic full collections off (young
    ones stay on) and reports every pass; restored afterwards (process-wide settings)."""
    import gc

    from bagel.coordinator.daemon import _tame_gc
    from bagel.coordinator.metrics import Metrics

    metrics = Metrics()
    before = gc.get_threshold()
    stop_watch = metrics.watch_gc()
    try:
        _tame_gc()
        assert gc.get_freeze_count() > 0
        t0, t1, t2 = gc.get_threshold()
        assert (t0, t1) == before[:2] and t0 > 0 and t2 >= 1 << 30
        gc.collect()  # what the daemon's periodic pass does
        metrics.flush_gc()
        assert 'bagel_gc_pause_seconds_count{generation="2"}' in metrics.text()
    finally:
        stop_watch()
        gc.unfreeze()
        gc.set_threshold(*before)


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v}


@pytest.mark.timeout(60)
async def test_worker_gauge_tally_matches_the_core(tmp_path: Path) -> None:
    """The shell's running tally (from effects) equals the core's full count, through
    registrations, leaves and a restart."""
    h = await start(tmp_path, cluster_spec_text("lcrun", lease_s=30.0, min_replicas=1, max_replicas=1))
    target = f"127.0.0.1:{h.port}"
    ids = [Identity.generate() for _ in range(12)]
    for i, ident in enumerate(ids):
        async with CoordinatorClient(target, ident, "lcrun") as c:
            await c.register(PROFILE, peer(str(i)))
    for ident in ids[:3]:
        async with CoordinatorClient(target, ident, "lcrun") as c:
            await c.leave("done")
    counts = _nonzero(h.state.counts())
    assert counts.get("left") == 3 and counts.get("standby", 0) > 0  # some had no cell left
    assert _nonzero(h.app.tally.counts()) == counts
    await h.stop()
    h2 = await start(tmp_path, cluster_spec_text("lcrun", lease_s=30.0, min_replicas=1, max_replicas=1))
    try:
        assert _nonzero(h2.app.tally.counts()) == _nonzero(h2.state.counts())
    finally:
        await h2.stop()

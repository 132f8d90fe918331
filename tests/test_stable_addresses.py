"""Stable addresses, in process with real hivemind DHT nodes: a coordinator stopped and
started again on the same data dir and DHT port prints the byte-identical join string
(peer id from `dht.key`, the same port, the same order); `announce` replaces the listen
addresses in it; a running worker's DHT node finds the restarted coordinator (on a new
gRPC port) through the same peer; and a worker's lookup given a join string whose first
peers are dead tries the others and finds the coordinator.

The SIGKILL-and-restart story with real processes is in tests/test_e2e.py
(`test_coordinator_sigkill_mid_round_loses_no_committed_round`).
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from bagel.coordinator.daemon import start_coordinator
from bagel.protocol.discovery import CoordinatorRecordValidator, lookup_coordinator, resolve_coordinator, start_dht
from bagel.protocol.joinstring import JoinInfo, parse_join_string
from bagel.protocol.runspec import parse_spec

from daemonproc import free_port
from simworkers import cluster_spec_text, uniform_cells


@pytest.fixture()
def _torch_shm_manager():
    """Start torch's shared-memory manager (hivemind's MPFuture uses it) before the per-test
    leak check looks: it lives for the whole session by design (see tests/test_discovery.py)."""
    import torch

    torch.empty(1).share_memory_()


@pytest.mark.timeout(120)
async def test_join_string_is_byte_identical_across_restarts_and_lookups_try_every_peer(
    tmp_path: Path, _torch_shm_manager
) -> None:
    spec = parse_spec(cluster_spec_text("stablerun"))
    data = tmp_path / "coord"
    dht_port = free_port()
    kwargs: dict[str, Any] = dict(
        cells=uniform_cells(spec.cell_ids), tick_ms=50, dht=True, dht_listen=f"/ip4/127.0.0.1/tcp/{dht_port}"
    )

    # announced addresses replace the listen addresses in the join string; the peer id stays
    announce = (f"/ip4/203.0.113.7/tcp/{dht_port}", "/dns4/coord.example.org/tcp/443")
    announced = await start_coordinator(spec, data, announce=announce, **kwargs)
    peer_id = str(announced.dht.peer_id.to_base58())
    try:
        assert announced.join is not None
        assert parse_join_string(announced.join).initial_peers == tuple(f"{a}/p2p/{peer_id}" for a in announce)
    finally:
        await announced.stop(0)
    assert stat.S_IMODE(os.stat(data / "dht.key").st_mode) == 0o600

    first = await start_coordinator(spec, data, **kwargs)
    join = first.join
    assert join is not None and str(first.dht.peer_id.to_base58()) == peer_id
    info = parse_join_string(join)
    assert info.initial_peers == (f"/ip4/127.0.0.1/tcp/{dht_port}/p2p/{peer_id}",)
    # a running worker's DHT node, kept across the coordinator's restart
    worker = await asyncio.to_thread(
        start_dht,
        initial_peers=list(info.initial_peers),
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[CoordinatorRecordValidator("stablerun", info.coordinator_public_key)],
    )
    try:
        assert (await resolve_coordinator(info, dht=worker, timeout_s=10)).endpoint == first.endpoint
        await first.stop(0)
        again = await start_coordinator(spec, data, **kwargs)
        try:
            assert again.join == join  # byte for byte
            # the running worker's node finds the restarted coordinator, which serves gRPC on
            # another port now, through the same peer id at the same address (what the
            # worker's link does when the old endpoint stops answering)
            assert again.endpoint != first.endpoint
            found = None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (found is None or found.endpoint != again.endpoint):
                found, _ = await lookup_coordinator(worker, info)
                await asyncio.sleep(0.2)
            assert found is not None and found.endpoint == again.endpoint
            # a join string can name several peers: dead ones first (a refused port, an
            # address nothing answers on) do not stop a new worker from finding the
            # coordinator through the rest
            dead = (
                f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
                "/ip4/203.0.113.9/tcp/7071/p2p/QmUMCRVrq3Wnfs2mAQsEMJNjvRD1h3DZtAZ8iugXQntQ79",
            )
            several = JoinInfo(info.run_id, info.coordinator_public_key, (*dead, *info.initial_peers))
            record = await resolve_coordinator(several, timeout_s=30, host_maddrs=("/ip4/127.0.0.1/tcp/0",))
            assert record.endpoint == again.endpoint
        finally:
            await again.stop(0)
    finally:
        await asyncio.to_thread(worker.shutdown)

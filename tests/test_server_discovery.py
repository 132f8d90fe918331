"""Discovery end to end: start the daemon process with its DHT
node, resolve the coordinator from the printed join string alone (a fresh DHT node in
this process, bootstrapped from the string's initial peers), call GetStatus on the
resolved endpoint over TLS pinned to the record's fingerprint; and refuse a join string
that names another coordinator key, even though the record is in the DHT (the
forged-record cases of the record itself are tested by the protocol layer's own tests).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bagel.protocol.client import CoordinatorClient
from bagel.protocol.discovery import CoordinatorNotFound, resolve_coordinator, start_dht
from bagel.protocol.identity import Identity
from bagel.protocol.joinstring import JoinInfo, parse_join_string
from bagel.protocol.runspec import parse_spec

from daemonproc import DaemonProcess
from simworkers import cluster_spec_text


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_resolve_daemon_from_join_string_and_call_it(tmp_path: Path) -> None:
    text = cluster_spec_text("discorun")
    spec_path = tmp_path / "disco.toml"
    spec_path.write_text(text)
    d = DaemonProcess(spec_path, tmp_path / "data", "--listen", "127.0.0.1:0", "--log-level", "WARNING")
    try:
        endpoint = d.wait_line("listening:", timeout_s=120)
        tls = d.wait_line("tls:")
        join = d.wait_line("join:")
        record = await resolve_coordinator(join, timeout_s=60, host_maddrs=("/ip4/127.0.0.1/tcp/0",))
        assert record.endpoint == endpoint
        assert record.run_id == "discorun" and record.spec_hash == parse_spec(text).spec_hash
        # the signed record and the join string both carry the served certificate's fingerprint
        assert tls == f"sha256 {record.tls_sha256}" and parse_join_string(join).tls_fingerprint == record.tls_sha256
        client = await CoordinatorClient.connect(
            record.endpoint, Identity.generate(), "discorun", tls_fingerprint=record.tls_sha256
        )
        async with client as c:
            st = await c.status()
        assert st.run_id == "discorun" and st.spec_hash == record.spec_hash
        assert len(st.cells) == 5

        # same DHT, same run, but a join string with another coordinator key: refused
        info = parse_join_string(join)
        forged = JoinInfo(info.run_id, Identity.generate().public_key, info.initial_peers).encode()
        with pytest.raises(CoordinatorNotFound, match="signature|refused|no record"):
            await resolve_coordinator(forged, timeout_s=5, host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    finally:
        d.close()


@pytest.fixture()
def _torch_shm_manager():
    """Start torch's shared-memory manager (hivemind's MPFuture uses it) before the per-test
    leak check looks: it lives for the whole session by design (see tests/test_discovery.py)."""
    import torch

    torch.empty(1).share_memory_()


@pytest.mark.timeout(120)
async def test_forgeries_planted_at_the_coordinator_node_do_not_hide_it(tmp_path: Path, _torch_shm_manager) -> None:
    """The coordinator's own DHT node validates: an attacker who stores forgeries with
    day-long expirations, under the coordinator's subkey and its own, gets none of them
    stored there, so a worker resolves the coordinator at once and connects pinned."""
    from hivemind.utils import get_dht_time

    from bagel.coordinator.daemon import start_coordinator
    from bagel.protocol.discovery import (
        CoordinatorRecord,
        CoordinatorRecordValidator,
        coordinator_key,
        lookup_direct,
        sign_record,
    )

    from simworkers import uniform_cells

    spec = parse_spec(cluster_spec_text("discorun"))
    h = await start_coordinator(
        spec, tmp_path / "d", cells=uniform_cells(spec.cell_ids), tick_ms=50, dht=True, tls=True
    )
    dhts = []
    try:
        assert h.join is not None
        info = parse_join_string(h.join)
        assert info.tls_fingerprint == h.tls_fingerprint != ""
        peers = list(info.initial_peers)
        attacker = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers)
        dhts.append(attacker)
        evil = Identity.generate()
        now = get_dht_time()
        day = now + 86400
        forged = CoordinatorRecord("6.6.6.6:1", "discorun", spec.spec_hash, evil.public_key, now, day, "ee" * 32)
        for subkey in (info.coordinator_public_key.hex(), evil.public_key.hex()):
            await attacker.store(
                coordinator_key("discorun"),
                sign_record(forged, evil),
                expiration_time=day,
                subkey=subkey,
                return_future=True,
            )
        # the coordinator's node refused both: asked directly, it holds the genuine entry only
        probe = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers)
        dhts.append(probe)
        record, refused = await lookup_direct(probe, info)
        assert record is not None and record.endpoint == h.endpoint and refused == []
        assert record.tls_sha256 == h.tls_fingerprint

        validators = [CoordinatorRecordValidator("discorun", info.coordinator_public_key)]
        worker = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers, record_validators=validators)
        dhts.append(worker)
        record = await resolve_coordinator(info, dht=worker, timeout_s=10, retry_interval_s=0.2)
        assert record.endpoint == h.endpoint
        client = await CoordinatorClient.connect(
            record.endpoint, Identity.generate(), "discorun", tls_fingerprint=record.tls_sha256
        )
        async with client as c:
            assert (await c.status()).run_id == "discorun"

        # a join string pinning another certificate refuses the genuine record: no downgrade
        # to an unpinned or differently pinned coordinator
        pinned_elsewhere = JoinInfo(info.run_id, info.coordinator_public_key, info.initial_peers, "ab" * 32)
        with pytest.raises(CoordinatorNotFound, match="pins"):
            await resolve_coordinator(pinned_elsewhere, dht=worker, timeout_s=1.0, retry_interval_s=0.2)
    finally:
        for dht in reversed(dhts):
            dht.shutdown()
        await h.stop(0)

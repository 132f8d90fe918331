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
from bagel.protocol.discovery import CoordinatorNotFound, resolve_coordinator
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

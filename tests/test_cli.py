"""`bagel-coordinator` as a real process: serve, status, SIGTERM, refusals.

The daemon runs with its hivemind DHT node, in its own process group; every test kills
the group in `finally`, so nothing leaks even when an assertion fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bagel.coordinator import cli
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.identity import Identity
from bagel.protocol.joinstring import parse_join_string
from bagel.protocol.tls import pinned_credentials

from daemonproc import DaemonProcess
from simworkers import cluster_spec_text, fake_peer_id


def write_spec(tmp_path: Path, run_id: str = "clirun", **kw) -> Path:
    p = tmp_path / f"{run_id}.toml"
    p.write_text(cluster_spec_text(run_id, **kw))
    return p


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bagel.coordinator", *args], capture_output=True, text=True, timeout=timeout
    )


async def health(target: str, service: str = "", *, tls_fingerprint: str = "") -> int:
    if tls_fingerprint:
        pinned = pinned_credentials(target, tls_fingerprint)
        channel = grpc.aio.secure_channel(target, pinned.credentials(), options=pinned.channel_options())
    else:
        channel = grpc.aio.insecure_channel(target)
    async with channel as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return resp.status


def test_help_names_every_flag(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--run",
        "--data-dir",
        "--listen",
        "--dht-listen",
        "--initial-peers",
        "--metrics-listen",
        "--tick-ms",
        "--grace-s",
        "--tls-cert",
        "--tls-key",
        "--insecure",
    ):
        assert flag in out
    with pytest.raises(SystemExit):
        cli.main(["status", "--help"])


def test_bad_spec_and_bad_flags_exit_2(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nid = "x"\n[schedule]\nlease_seconds = 3\n')
    assert cli.main(["serve", "--run", str(bad), "--data-dir", str(tmp_path / "d")]) == 2
    assert "schedule.lease_seconds" in capsys.readouterr().err
    assert cli.main(["status"]) == 2
    good = write_spec(tmp_path)
    serve = ["serve", "--run", str(good), "--data-dir", str(tmp_path / "d"), "--listen", "127.0.0.1:0", "--no-dht"]
    assert cli.main([*serve, "--tls-cert", str(good)]) == 2
    assert "both --tls-cert and --tls-key" in capsys.readouterr().err
    assert cli.main([*serve, "--insecure", "--tls-cert", str(good), "--tls-key", str(good)]) == 2
    assert "--insecure contradicts" in capsys.readouterr().err
    assert cli.main(["status", "--target", "127.0.0.1:1", "--tls-fingerprint", "xyz"]) == 2
    assert "64 hex digits" in capsys.readouterr().err


def test_unusable_tls_certificate_is_one_error_line(tmp_path: Path) -> None:
    spec_path = write_spec(tmp_path)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    data = ["--data-dir", str(tmp_path / "d"), "--listen", "127.0.0.1:0", "--no-dht"]
    r = run_cli("serve", "--run", str(spec_path), *data, "--tls-cert", str(junk), "--tls-key", str(junk))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "no PEM certificate" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(180)
def test_serve_status_sigterm_and_refusals(tmp_path: Path) -> None:
    spec_path = write_spec(tmp_path)
    data = tmp_path / "data"
    d = DaemonProcess(spec_path, data, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--tick-ms", "50")
    try:
        endpoint = d.wait_line("listening:", timeout_s=120)
        tls = d.wait_line("tls:")  # TLS is on by default, with a self-signed certificate in the data dir
        assert tls.startswith("sha256 ")
        fingerprint = tls.removeprefix("sha256 ")
        join = d.wait_line("join:")
        assert join.startswith("bagel1:")
        assert parse_join_string(join).tls_fingerprint == fingerprint
        assert stat.S_IMODE((data / "tls.key").stat().st_mode) == 0o600
        metrics_url = d.wait_line("metrics:")
        pinned = health(endpoint, tls_fingerprint=fingerprint)
        assert asyncio.run(pinned) == health_pb2.HealthCheckResponse.SERVING
        pinned = health(endpoint, "bagel.v1.Coordinator", tls_fingerprint=fingerprint)
        assert asyncio.run(pinned) == health_pb2.HealthCheckResponse.SERVING

        async def register() -> str:
            client = await CoordinatorClient.connect(
                endpoint, Identity.generate(), "clirun", tls_fingerprint=fingerprint
            )
            async with client as c:
                resp = await c.register(
                    pb.WorkerProfile(name="cli-w", device_kind="cpu", vram_bytes=8 << 30, num_devices=1),
                    pb.PeerAddress(peer_id=fake_peer_id("cli"), maddrs=["/ip4/127.0.0.1/tcp/1"]),
                )
                return resp.worker_id

        wid = asyncio.run(register())
        key = data / "coordinator.key"
        assert stat.S_IMODE(key.stat().st_mode) == 0o600

        # status, read-only from the store while the daemon runs
        st = run_cli("status", "--data-dir", str(data), "--json")
        assert st.returncode == 0, st.stderr
        doc = json.loads(st.stdout)
        assert doc["run_id"] == "clirun" and [w["worker_id"] for w in doc["workers"]] == [wid]
        assert {c["cell_id"] for c in doc["cells"]} == {"k0.r0", "k0.r1", "k1.r0", "k1.r1", "router"}
        table = run_cli("status", "--data-dir", str(data))
        assert table.returncode == 0 and "cli-w" in table.stdout and "k1.r1" in table.stdout
        live = run_cli("status", "--target", endpoint, "--tls-fingerprint", fingerprint, "--key", str(key), "--json")
        assert live.returncode == 0, live.stderr
        assert json.loads(live.stdout)["workers"][0]["worker_id"] == wid
        # the TLS matrix from the command line: no pin given, plaintext, a wrong pin
        unpinned = run_cli("status", "--target", endpoint)
        assert unpinned.returncode == 2 and "--tls-fingerprint" in unpinned.stderr
        plain = run_cli("status", "--target", endpoint, "--insecure")
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr and "--tls-fingerprint" in plain.stderr
        wrong = run_cli("status", "--target", endpoint, "--tls-fingerprint", "ab" * 32)
        assert wrong.returncode == 1 and "not the pinned" in wrong.stderr
        for refused in (unpinned, plain, wrong):
            assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
        public = run_cli("status", "--target", endpoint, "--tls-fingerprint", fingerprint, "--json")
        assert public.returncode == 0, public.stderr
        doc = json.loads(public.stdout)
        assert doc["workers"] == [] and doc["detailed"] is False
        assert sum(int(n) for state, n in doc["worker_counts"].items() if state != "standby") == 1

        # metrics endpoint
        import urllib.request

        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert 'bagel_rpc_latency_seconds_count{method="Register"} 1.0' in text

        # a second daemon on the same data dir is refused
        second = run_cli(
            "serve", "--run", str(spec_path), "--data-dir", str(data), "--listen", "127.0.0.1:0", "--no-dht"
        )
        assert second.returncode == 2 and "another coordinator is running" in second.stderr

        # SIGTERM: clean exit 0, DHT child gone with it
        d.signal(signal.SIGTERM)
        assert d.wait(60) == 0, "\n".join(d.stderr[-20:])
    finally:
        d.close()
    with pytest.raises(ProcessLookupError):
        os.killpg(d.proc.pid, 0)  # no process of the daemon's group survived

    # a restart reuses the certificate: the fingerprint (and so the join string) stays the same
    again = DaemonProcess(spec_path, data, "--listen", "127.0.0.1:0", "--no-dht")
    try:
        assert again.wait_line("tls:", timeout_s=120) == tls
    finally:
        again.close()

    # another spec on the same data dir is refused with a clear message
    other = write_spec(tmp_path, "clirun", lease_s=3.0)
    refused = run_cli("serve", "--run", str(other), "--data-dir", str(data), "--listen", "127.0.0.1:0", "--no-dht")
    assert refused.returncode == 2
    assert "immutable" in refused.stderr and "spec" in refused.stderr

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
from dataclasses import dataclass
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


@pytest.mark.slow
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
                    pb.WorkerProfile(
                        name="cli-w", device_kind="cpu", vram_bytes=8 << 30, host_memory_bytes=8 << 30, num_devices=1
                    ),
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
        assert doc["workers"][0]["host_memory_bytes"] == 8 << 30  # the declared RAM, kept in the store
        assert {c["cell_id"] for c in doc["cells"]} == {"k0.r0", "k0.r1", "k1.r0", "k1.r1", "router"}
        table = run_cli("status", "--data-dir", str(data))
        assert table.returncode == 0 and "cli-w" in table.stdout and "k1.r1" in table.stdout
        live = run_cli("status", "--target", endpoint, "--tls-fingerprint", fingerprint, "--key", str(key), "--json")
        assert live.returncode == 0, live.stderr
        live_worker = json.loads(live.stdout)["workers"][0]
        assert live_worker["worker_id"] == wid and live_worker["host_memory_bytes"] == 8 << 30
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

        # a worker whose memory holds none of the run's cells says so in one line (exit 2)
        # once the spec tells it what the cells need, instead of running out of memory measuring
        small = subprocess.run(
            [sys.executable, "-m", "bagel.worker", "join", join, "--data-dir", str(tmp_path / "small")]
            + ["--dht-listen", "/ip4/127.0.0.1/tcp/0", "--max-vram-gb", "0.001", "--quiet"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert small.returncode == 2, small.stderr
        assert len(small.stderr.strip().splitlines()) == 1 and "Traceback" not in small.stderr, small.stderr
        assert "holds none of the run's cells" in small.stderr and "--max-vram-gb" in small.stderr, small.stderr

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


# ---------------------------------------------------------------------------- one line for every failure


@dataclass
class Bad:
    """One refused command line: the program, its arguments (`{T}` is the case's temp dir,
    `{J}` a well-formed join string, `{S}` a good spec), the exit code, a phrase of its
    one line, and the data dir that must be unchanged afterwards ("" = none; a path that did
    not exist before must not exist after)."""

    name: str
    prog: str
    argv: str
    code: int
    says: str
    data_dir: str = ""


SPEC_FLAGS = "--listen 127.0.0.1:0 --insecure --no-dht"
BAD = [
    Bad(
        "listen-no-port", "coordinator", "serve --run {S} --data-dir {T}/d --listen localhost", 2, "explicit port", "d"
    ),
    Bad(
        "listen-port-range", "coordinator", "serve --run {S} --data-dir {T}/d --listen 127.0.0.1:70000", 2, "range", "d"
    ),
    Bad("dht-listen", "coordinator", "serve --run {S} --data-dir {T}/d --dht-listen tcp:7071", 2, "multiaddr", "d"),
    Bad("initial-peers", "coordinator", "serve --run {S} --data-dir {T}/d --initial-peers nope", 2, "multiaddr", "d"),
    Bad("data-dir-file", "coordinator", "serve --run {S} --data-dir {T}/file " + SPEC_FLAGS, 2, "is a file", "file"),
    Bad(
        "codec-int9", "coordinator", "serve --run {T}/int9.toml --data-dir {T}/d " + SPEC_FLAGS, 2, "diloco.codec", "d"
    ),
    Bad("max-bytes-0", "coordinator", "serve --run {T}/mb0.toml --data-dir {T}/d " + SPEC_FLAGS, 2, "max_bytes", "d"),
    Bad("data-path", "coordinator", "serve --run {T}/path.toml --data-dir {T}/d " + SPEC_FLAGS, 2, "data.path", "d"),
    Bad("data-empty", "coordinator", "serve --run {T}/empty.toml --data-dir {T}/d " + SPEC_FLAGS, 2, "no PNG", "d"),
    Bad("spec-syntax", "coordinator", "serve --run {T}/syntax.toml --data-dir {T}/d " + SPEC_FLAGS, 2, "run spec", "d"),
    Bad("spec-missing", "coordinator", "serve --run {T}/none.toml --data-dir {T}/d " + SPEC_FLAGS, 2, "run spec", "d"),
    Bad("tick-ms", "coordinator", "serve --run {S} --data-dir {T}/d --tick-ms 5 " + SPEC_FLAGS, 2, "--tick-ms", "d"),
    Bad("unknown-flag", "coordinator", "serve --run {S} --data-dir {T}/d --frobnicate", 2, "unrecognized", "d"),
    Bad(
        "grpc-port-used",
        "coordinator",
        "serve --run {S} --data-dir {T}/d --listen {P} --insecure --no-dht",
        1,
        "in use",
        "d",
    ),
    Bad(
        "metrics-port-used",
        "coordinator",
        "serve --run {S} --data-dir {T}/d --metrics-listen {P} " + SPEC_FLAGS,
        1,
        "in use",
        "d",
    ),
    Bad("truncated-store", "coordinator", "serve --run {S} --data-dir {T}/trunc " + SPEC_FLAGS, 1, "damaged", "trunc"),
    Bad("corrupt-key", "coordinator", "serve --run {S} --data-dir {T}/badkey " + SPEC_FLAGS, 1, "malformed", "badkey"),
    Bad("status-nothing", "coordinator", "status", 2, "exactly one of"),
    Bad("status-missing", "coordinator", "status --data-dir {T}/d", 2, "no coordinator database", "d"),
    Bad("status-truncated", "coordinator", "status --data-dir {T}/trunc", 1, "damaged", "trunc"),
    Bad("token-list-missing", "coordinator", "token list --data-dir {T}/d", 2, "no coordinator database", "d"),
    Bad(
        "token-create-uses",
        "coordinator",
        "token create --data-dir {T}/d --expires-s 9 --uses 0 --name a",
        2,
        "--uses",
        "d",
    ),
    Bad("no-command", "coordinator", "", 2, "required"),
    Bad("join-garbage", "worker", "join garbage --data-dir {T}/w", 2, "JOIN_STRING", "w"),
    Bad("worker-data-dir-file", "worker", "join {J} --data-dir {T}/file", 2, "is a file", "file"),
    Bad("worker-dht-listen", "worker", "join {J} --data-dir {T}/w --dht-listen 0.0.0.0:1", 2, "multiaddr", "w"),
    Bad("worker-throttle", "worker", "join {J} --data-dir {T}/w --throttle 0.5", 2, "--throttle", "w"),
    Bad("worker-token", "worker", "join {J} --data-dir {T}/w --token nonsense", 2, "--token", "w"),
    Bad("worker-bad-identity", "worker", "join {J} --data-dir {T}/badid", 1, "malformed", "badid"),
    Bad("worker-second", "worker", "join {J} --data-dir {T}/held", 2, "another worker", "held"),
    Bad("worker-unknown-flag", "worker", "join {J} --frobnicate", 2, "unrecognized"),
    Bad("sim-missing", "sim", "run {T}/none.toml --out {T}/out", 2, "none.toml", "out"),
    Bad("sim-out-file", "sim", "run {C} --out {T}/file", 2, "is a file", "file"),
    Bad("sim-workers", "sim", "run {C} --out {T}/out --workers 0", 2, "--workers", "out"),
    Bad("sim-policies", "sim", "run {C} --out {T}/out --policies nope", 2, "--policies", "out"),
    Bad("sim-chaos-missing", "sim", "chaos {T}/none.toml --out {T}/out", 2, "none.toml", "out"),
]


def _tree(path: Path) -> dict[str, str] | None:
    """Every file under `path` with its sha256 (None: `path` does not exist)."""
    import hashlib

    if not path.exists():
        return None
    if path.is_file():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(path.rglob("*"))
    }


def _case_dir(root: Path, bad: Bad, spec_text: str) -> Path:
    """The case's own temp dir with every fixture a case may name."""
    from bagel.coordinator.store import DB_NAME

    t = root / bad.name
    t.mkdir()
    (t / "file").write_text("not a directory\n")
    (t / "int9.toml").write_text(spec_text.replace("[diloco]\n", '[diloco]\ncodec = "int9"\n'))
    (t / "mb0.toml").write_text(spec_text.replace("[checkpoint]\n", "[checkpoint]\nmax_bytes = 0\n"))
    (t / "path.toml").write_text(spec_text.replace('source = "digits"', f'source = "folder"\npath = "{t}/nowhere"'))
    (t / "images").mkdir()
    (t / "empty.toml").write_text(spec_text.replace('source = "digits"', f'source = "folder"\npath = "{t}/images"'))
    (t / "syntax.toml").write_text("[run\nid = 1\n")
    (t / "trunc").mkdir()
    (t / "trunc" / DB_NAME).write_bytes(b"SQLite format 3\x00" + b"\x10\x00" + bytes(3000))
    for d, key in (("badkey", "coordinator.key"), ("badid", "identity.key")):
        (t / d).mkdir(mode=0o700)
        (t / d / key).write_bytes(b"junk")
        (t / d / key).chmod(0o600)
    (t / "held").mkdir(mode=0o700)
    return t


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_failure_is_one_line_with_its_code(tmp_path: Path) -> None:
    import socket

    from bagel.protocol.identity import Identity
    from bagel.protocol.joinstring import make_join_string
    from bagel.worker.datadirlock import DataDirLock

    from daemonproc import ForkLauncher

    spec_text = cluster_spec_text("badrun")
    spec = tmp_path / "good.toml"
    spec.write_text(spec_text)
    join = make_join_string(
        "badrun", Identity.generate().public_key, [f"/ip4/127.0.0.1/tcp/1/p2p/{fake_peer_id('b')}"], ""
    )
    chaos = Path(cli.__file__).parents[1] / "sim" / "scenarios" / "churn.toml"
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = f"127.0.0.1:{busy.getsockname()[1]}"
    cases: dict[str, list[dict]] = {"coordinator": [], "worker": [], "sim": []}
    before: dict[str, dict[str, str] | None] = {}
    locks = []
    for bad in BAD:
        t = _case_dir(tmp_path, bad, spec_text)
        if bad.name == "worker-second":
            locks.append(DataDirLock.acquire(t / "held"))  # a worker already runs there
        argv = bad.argv.format(T=t, S=spec, J=join, P=port, C=chaos).split()
        if bad.data_dir:
            before[bad.name] = _tree(t / bad.data_dir)
        out, err = t / "stdout", t / "stderr"
        cases[bad.prog].append({"name": bad.name, "argv": argv, "out": str(out), "err": str(err)})
    launchers = [ForkLauncher.start(prog, cs) for prog, cs in cases.items()]
    try:
        problems = []
        for bad in BAD:
            launcher = launchers[list(cases).index(bad.prog)]
            code = launcher.wait_code(bad.name, 240)
            t = tmp_path / bad.name
            err = (t / "stderr").read_text()
            lines = err.strip().splitlines()
            if code != bad.code:
                problems.append(f"{bad.name}: exit {code}, expected {bad.code}: {err[-500:]}")
            elif len(lines) != 1 or "Traceback" in err:
                problems.append(f"{bad.name}: {len(lines)} lines on stderr, expected one:\n{err[-1500:]}")
            elif bad.says not in lines[0]:
                problems.append(f"{bad.name}: {lines[0]!r} does not say {bad.says!r}")
            if bad.data_dir and _tree(t / bad.data_dir) != before[bad.name]:
                problems.append(f"{bad.name}: {bad.data_dir} changed: {before[bad.name]} -> {_tree(t / bad.data_dir)}")
        assert not problems, "\n".join(problems)
    finally:
        for launcher in launchers:
            launcher.close()
        for lock in locks:
            lock.release()
        busy.close()


def test_version_on_every_command(capsys) -> None:
    from bagel.sim import cli as sim_cli
    from bagel.worker import cli as worker_cli

    for prog, main in (("bagel-coordinator", cli.main), ("bagel-worker", worker_cli.main), ("bagel-sim", sim_cli.main)):
        with pytest.raises(SystemExit) as e:
            main(["--version"])
        assert e.value.code == 0
        out = capsys.readouterr().out.strip()
        assert out.startswith(prog + " ") and out.split()[1][0].isdigit(), out

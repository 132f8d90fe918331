"""The network test bed (sim/netlab/): its plan everywhere; on a machine that allows network
namespaces (root, iproute2, nftables), the bed itself: NAT out, nothing in, tbf caps a link,
a partition cuts and healing restores, nothing leaves the bed, teardown leaves nothing.

Every check that could pass by accident has its control in the same test: the capped rate
is compared with the same link unshaped, the refused inbound connection with the same
connection once the firewall lets it through, the partition with the link before and after.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bagel.sim.netlab.bed import NetLab, NetLabError, Shape, bed_namespaces, missing_prerequisite
from bagel.sim.netlab.topology import IFNAMSIZ, TopologyError, plan

BED = [ipaddress.ip_network(n) for n in ("198.51.100.0/24", "203.0.113.0/24", "192.168.0.0/16")]
PROBE = [sys.executable, "-m", "bagel.sim.netlab.probe"]
REASON = missing_prerequisite()
needs_bed = pytest.mark.skipif(REASON is not None, reason=f"no network test bed here: {REASON}")


# ---------------------------------------------------------------------------- the plan (no root)


def test_plan_uses_only_documentation_and_private_ranges_and_short_device_names() -> None:
    topo = plan("t", homes=3, per_home=4, public=2)
    assert [n.name for n in topo.homes()] == ["home1", "home2", "home3"]
    assert len(topo.hosts()) == 1 + 2 + 3 * 4
    for n in topo.links():
        for addr in (n.addr, n.lan) if n.lan else (n.addr,):
            assert any(ipaddress.ip_interface(addr).ip in net for net in BED), addr
        assert ipaddress.ip_address(n.gateway) in ipaddress.ip_interface(n.addr).network
        assert len(n.dev) <= IFNAMSIZ and len(n.parent_dev) <= IFNAMSIZ
        assert n.ns.startswith("bagelnl-t-")
    # the public side holds documentation ranges only; RFC 1918 addresses only behind a router
    docs = BED[:2]
    for n in topo.links():
        inside = ipaddress.ip_interface(n.addr).ip
        assert any(inside in net for net in docs) == (n.parent == "core"), n
    assert len({n.addr for n in topo.links()}) == len(topo.links())


@pytest.mark.parametrize("bad", [dict(tag="UP"), dict(tag="a-b"), dict(tag=""), dict(homes=9), dict(public=-1)])
def test_plan_refuses_bad_names_and_counts(bad: dict[str, Any]) -> None:
    with pytest.raises(TopologyError):
        plan(**bad)


def test_shape_refuses_impossible_values() -> None:
    for kwargs in (dict(rate_mbit=0.0), dict(delay_ms=-1.0), dict(loss_pct=101.0)):
        with pytest.raises(ValueError):
            Shape(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- helpers


def probe(lab: NetLab, node: str, *args: str, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    """Run one probe in `node` and parse its JSON line."""
    done = subprocess.run(
        ["ip", "netns", "exec", lab.topology.node(node).ns, *PROBE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"probe {args} in {node} printed nothing: {done.stderr[-2000:]}"
    return done.returncode, json.loads(lines[-1])


def start_sink(lab: NetLab, node: str, port: int) -> subprocess.Popen[str]:
    proc = lab.run_in(node, [*PROBE, "sink", "--port", str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 20.0)
    assert ready, f"sink in {node} did not start"
    assert json.loads(proc.stdout.readline()) == {"listening": port}
    return proc


def in_ns(lab: NetLab, node: str, *argv: str) -> None:
    subprocess.run(["ip", "netns", "exec", lab.topology.node(node).ns, *argv], check=True, timeout=20)


@pytest.fixture
def lab() -> Iterator[NetLab]:
    # One tag per pytest worker: two tests of this module may run at once under xdist, and a
    # bed's setup first removes whatever its tag left, so a shared tag tore down the other's bed.
    tag = "pt" + os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    with NetLab(tag=tag, homes=2, per_home=2, public=1) as bed:
        yield bed
    assert bed_namespaces(bed.topology.prefix) == []


# ---------------------------------------------------------------------------- the bed (root)


@needs_bed
@pytest.mark.timeout(90)
def test_home_hosts_reach_the_public_coordinator_through_their_nat(lab: NetLab) -> None:
    start_sink(lab, "coord", 9000)
    for node, public_ip in (("home1-1", "203.0.113.11"), ("home2-2", "203.0.113.12"), ("pub1", "198.51.100.11")):
        rc, got = probe(lab, node, "send", "--to", "198.51.100.10:9000", "--seconds", "0.2")
        assert rc == 0, got
        assert got["delivered"] == got["sent"] > 0
        # the coordinator sees the home router's public address, never the private one
        assert got["seen_as"] == public_ip


@needs_bed
@pytest.mark.timeout(90)
def test_the_public_side_cannot_open_a_connection_into_a_home(lab: NetLab) -> None:
    start_sink(lab, "home1-1", 9001)
    # the sink is up: a host on the same LAN reaches it
    assert probe(lab, "home1-2", "connect", "--to", "192.168.1.11:9001")[0] == 0
    # no port forward on the router's public address
    rc, got = probe(lab, "coord", "connect", "--to", "203.0.113.11:9001", "--timeout", "2")
    assert rc == 1 and got["connected"] is False
    # an attacker next to the router, routing the private range to it, is dropped by the NAT
    in_ns(lab, "core", "ip", "route", "add", "192.168.1.0/24", "via", "203.0.113.11")
    rc, got = probe(lab, "coord", "connect", "--to", "192.168.1.11:9001", "--timeout", "2")
    assert rc == 1 and got["connected"] is False
    # control: the same path opens once the router's forward chain lets new inbound flows through
    in_ns(lab, "home1", "nft", "insert", "rule", "inet", "bagelnl_nat", "forward", "iifname", "wan", "accept")
    assert probe(lab, "coord", "connect", "--to", "192.168.1.11:9001")[0] == 0


@needs_bed
@pytest.mark.timeout(90)
def test_tbf_caps_a_link_to_its_rate(lab: NetLab) -> None:
    start_sink(lab, "coord", 9002)
    rc, free = probe(lab, "home1-1", "send", "--to", "198.51.100.10:9002", "--seconds", "0.5")
    assert rc == 0, free
    cap = 8.0
    lab.shape("home1", rate_mbit=cap, direction="up")
    assert "tbf" in lab.qdiscs("home1")["up"] and "tbf" not in lab.qdiscs("home1")["down"]
    rc, capped = probe(lab, "home1-1", "send", "--to", "198.51.100.10:9002", "--seconds", "1.5")
    assert rc == 0, capped
    # rates from delivered bytes over the sender's own elapsed time (start to the sink's count);
    # unshaped, the same veth path carries many times the cap
    assert capped["mbit_s"] <= cap * 1.15, capped
    assert capped["delivered"] >= 100_000, capped  # the capped link still carries traffic
    assert free["mbit_s"] >= 4 * capped["mbit_s"], (free, capped)
    # the other home's uplink is untouched
    rc, other = probe(lab, "home2-1", "send", "--to", "198.51.100.10:9002", "--seconds", "0.5")
    assert rc == 0 and other["mbit_s"] >= 4 * capped["mbit_s"], other


@needs_bed
@pytest.mark.timeout(90)
def test_tbf_caps_the_download_direction_separately(lab: NetLab) -> None:
    src = lab.run_in(
        "coord", [*PROBE, "source", "--port", "9006", "--seconds", "1.0"], stdout=subprocess.PIPE, text=True
    )
    assert src.stdout is not None
    ready, _, _ = select.select([src.stdout], [], [], 20.0)
    assert ready and json.loads(src.stdout.readline()) == {"listening": 9006}
    cap = 8.0
    lab.shape("home1", rate_mbit=cap, direction="down")
    rc, capped = probe(lab, "home1-1", "fetch", "--to", "198.51.100.10:9006")
    assert rc == 0, capped
    rc, free = probe(lab, "home2-1", "fetch", "--to", "198.51.100.10:9006")
    assert rc == 0, free
    assert capped["mbit_s"] <= cap * 1.15 and capped["received"] >= 100_000, capped
    assert free["mbit_s"] >= 4 * capped["mbit_s"], (free, capped)
    # the cap is on the download only: the same home's upload is not limited
    start_sink(lab, "coord", 9007)
    rc, up = probe(lab, "home1-1", "send", "--to", "198.51.100.10:9007", "--seconds", "0.5")
    assert rc == 0 and up["mbit_s"] >= 4 * capped["mbit_s"], up


@needs_bed
@pytest.mark.timeout(90)
def test_a_partition_cuts_a_home_off_and_heal_restores_it(lab: NetLab) -> None:
    start_sink(lab, "coord", 9003)
    assert probe(lab, "home1-1", "connect", "--to", "198.51.100.10:9003")[0] == 0
    lab.shape("home1", rate_mbit=50.0)  # a partition keeps the link's shaping
    lab.partition("home1")
    rc, got = probe(lab, "home1-1", "connect", "--to", "198.51.100.10:9003", "--timeout", "2")
    assert rc == 1 and got["connected"] is False
    assert probe(lab, "home2-1", "connect", "--to", "198.51.100.10:9003")[0] == 0  # only home1 is cut
    lab.heal("home1")
    assert probe(lab, "home1-1", "connect", "--to", "198.51.100.10:9003")[0] == 0
    assert "tbf" in lab.qdiscs("home1")["up"]


@needs_bed
@pytest.mark.timeout(90)
def test_full_loss_drops_and_no_loss_delivers(lab: NetLab) -> None:
    start_sink(lab, "coord", 9004)
    lab.shape("home1-1", loss_pct=100.0, direction="up")
    rc, got = probe(lab, "home1-1", "connect", "--to", "198.51.100.10:9004", "--timeout", "2")
    assert rc == 1 and got["connected"] is False
    lab.shape("home1-1", direction="up")
    assert probe(lab, "home1-1", "connect", "--to", "198.51.100.10:9004")[0] == 0


def udp_delivered(lab: NetLab, src: str, dst: str, port: int, count: int) -> int:
    sink = lab.run_in(dst, [*PROBE, "udp-sink", "--port", str(port)], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    ready, _, _ = select.select([sink.stdout], [], [], 20.0)
    assert ready and json.loads(sink.stdout.readline()) == {"listening": port}
    assert probe(lab, src, "udp-send", "--to", f"{lab.ip(dst)}:{port}", "--count", str(count))[0] == 0
    out, _ = sink.communicate(timeout=30)
    return int(json.loads(out.strip().splitlines()[-1])["received"])


@needs_bed
@pytest.mark.timeout(90)
def test_loss_drops_about_its_share_of_packets(lab: NetLab) -> None:
    n = 2000
    clean = udp_delivered(lab, "pub1", "coord", 9101, n)
    lab.shape("pub1", loss_pct=30.0, direction="up")
    lossy = udp_delivered(lab, "pub1", "coord", 9102, n)
    # Bernoulli(0.3) over 2000 packets: 1400 +- 20 (one standard deviation)
    assert clean >= 0.97 * n, clean
    assert 0.6 * n <= lossy <= 0.8 * n, lossy


@needs_bed
@pytest.mark.timeout(60)
def test_nothing_routes_out_of_the_bed(lab: NetLab) -> None:
    for n in lab.topology.nodes:
        routes = json.loads(
            subprocess.run(["ip", "-n", n.ns, "-j", "route"], capture_output=True, text=True, check=True).stdout
        )
        for r in routes:
            if r["dst"] == "default":
                assert n.name != "core", "the core must have no default route"
                assert any(ipaddress.ip_address(r["gateway"]) in net for net in BED), (n.name, r)
            else:
                assert any(ipaddress.ip_network(r["dst"]).subnet_of(net) for net in BED), (n.name, r)  # type: ignore[arg-type]
    # an address outside the bed is unreachable from inside it
    rc, got = probe(lab, "home1-1", "connect", "--to", "192.0.2.1:80", "--timeout", "2")
    assert rc == 1 and got["connected"] is False


@needs_bed
@pytest.mark.timeout(60)
def test_setup_removes_a_killed_runs_leftovers_and_teardown_leaves_nothing() -> None:
    # a killed run's leftover: a namespace of the tag, with a process still inside
    subprocess.run(["ip", "netns", "add", "bagelnl-lt-core"], check=True, timeout=20)
    stray = subprocess.Popen(["ip", "netns", "exec", "bagelnl-lt-core", "sleep", "60"], start_new_session=True)
    lab = NetLab(tag="lt", homes=1, per_home=1, public=0)
    try:
        lab.setup()
        assert stray.wait(timeout=10) != 0  # killed by the cleanup
        assert len(bed_namespaces("bagelnl-lt-")) == len(lab.topology.nodes)
        sink = start_sink(lab, "coord", 9005)
    finally:
        lab.teardown()
    assert bed_namespaces("bagelnl-lt-") == []
    assert sink.poll() is not None
    lab.teardown()  # idempotent
    assert not lab.procs


@needs_bed
def test_delay_is_refused_by_name_where_the_kernel_has_no_netem(lab: NetLab) -> None:
    if lab.has_netem:
        lab.shape("home1", delay_ms=20.0)
        assert "netem" in lab.qdiscs("home1")["up"]
    else:
        with pytest.raises(NetLabError, match="sch_netem"):
            lab.shape("home1", delay_ms=20.0)


def test_missing_prerequisite_names_a_reason_or_none() -> None:
    assert REASON is None or REASON.startswith(("netlab needs", "this machine refuses", "nftables", "netlab cannot"))


def test_the_skip_reason_names_root_and_each_missing_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    import bagel.sim.netlab.bed as bed

    monkeypatch.setattr(bed.os, "geteuid", lambda: 1000)
    assert missing_prerequisite() == "netlab needs root (network namespaces, nftables and tc)"
    monkeypatch.setattr(bed.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bed.shutil, "which", lambda tool: None if tool == "nft" else f"/usr/sbin/{tool}")
    reason = missing_prerequisite()
    assert reason is not None and "`nft`" in reason and "nftables" in reason


def netlab_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bagel.sim.netlab", *args], capture_output=True, text=True, timeout=60)


@needs_bed
@pytest.mark.timeout(120)
def test_the_cli_builds_changes_and_removes_a_bed_with_one_line_errors() -> None:
    try:
        up = netlab_cli("up", "--tag", "cl", "--homes", "1", "--per-home", "1", "--public", "0")
        assert up.returncode == 0, up.stderr
        assert "home1-1" in up.stdout and "192.168.1.11/24" in up.stdout and "20 Mbit/s up" in up.stdout
        assert len(bed_namespaces("bagelnl-cl-")) == 4
        assert netlab_cli("partition", "home1", "--tag", "cl").returncode == 0
        status = netlab_cli("status", "--tag", "cl")
        assert status.returncode == 0 and "rate 20Mbit" in status.stdout, status.stdout
        for bad, code in ((("shape", "nope", "--tag", "cl"), 2), (("shape", "home1", "--rate", "0", "--tag", "cl"), 2)):
            got = netlab_cli(*bad)
            assert got.returncode == code and len(got.stderr.strip().splitlines()) == 1, got.stderr
            assert "Traceback" not in got.stderr
    finally:
        down = netlab_cli("down", "--tag", "cl")
    assert down.returncode == 0 and bed_namespaces("bagelnl-cl-") == []
    gone = netlab_cli("status", "--tag", "cl")
    assert gone.returncode == 1 and gone.stderr.strip().count("\n") == 0 and "no test bed" in gone.stderr


# ---------------------------------------------------------------------------- a real run on the bed


def _log_events(path: Path, kind: str) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                rec = json.loads(line)
                if rec.get("event") == kind:
                    out.append(rec)
    return out


@needs_bed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workers_behind_two_different_nats_average_through_the_relay(tmp_path: Path) -> None:
    """The real coordinator on the public segment (TLS gRPC and its DHT on 198.51.100.10, which
    also serves as the libp2p circuit relay), a worker behind each of the two NATs and one
    public worker: all join with the printed join string, report how they are reached, and
    commit rounds they averaged together with equal state hashes. The two home workers accept
    no inbound connection, so each reaches the other only through the relay.

    Control: the reachability verdicts differ by placement (relayed at home, direct in public),
    and the home workers' logged connection to each other is the relay circuit."""
    from test_e2e import SPEC

    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    nodes = ("home1-1", "home2-1", "pub1")
    with NetLab(tag="rr", homes=2, per_home=1, public=1) as lab:

        def start(node: str, argv: list[str]) -> Path:
            log = tmp_path / f"{node}.log"
            with open(log, "ab") as f:
                lab.run_in(node, argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            return log

        coord = start(
            "coord",
            [sys.executable, "-m", "bagel.coordinator", "serve", "--run", str(spec),
             "--data-dir", str(tmp_path / "coord"), "--listen", "198.51.100.10:7070",
             "--dht-listen", "/ip4/198.51.100.10/tcp/7071", "--tick-ms", "100"],
        )  # fmt: skip
        join = ""
        deadline = time.monotonic() + 120
        while not join and time.monotonic() < deadline:
            lines = coord.read_text(errors="replace").splitlines() if coord.exists() else []
            join = next((ln.removeprefix("join:").strip() for ln in lines if ln.startswith("join:")), "")
            time.sleep(0.2)
        assert join, coord.read_text()[-3000:]
        logs = {
            node: start(
                node,
                [
                    sys.executable,
                    "-m",
                    "bagel.worker",
                    "join",
                    join,
                    "--data-dir",
                    str(tmp_path / node),
                    "--log-json",
                    "--name",
                    node,
                    "--reduce-timeout-s",
                    "20",
                ],
            )  # fmt: skip
            for node in nodes
        }

        def shared() -> dict[str, dict[int, str]]:
            return {
                n: {e["round"]: e["hash"] for e in _log_events(p, "committed") if e.get("contributors", 0) >= 3}
                for n, p in logs.items()
            }

        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and min(len(c) for c in shared().values()) < 3:
            time.sleep(1.0)
    commits = shared()
    tails = {n: p.read_text(errors="replace")[-1500:] for n, p in logs.items()}
    assert all(len(c) >= 3 for c in commits.values()), tails
    every = set.intersection(*(set(c) for c in commits.values()))
    assert every, commits
    assert all(len({commits[n][r] for n in nodes}) == 1 for r in every)
    reach = {n: _log_events(p, "reachability")[-1] for n, p in logs.items()}
    assert reach["pub1"]["reachability"] == "direct", reach["pub1"]
    for home in ("home1-1", "home2-1"):
        assert reach[home]["reachability"] == "relayed", reach[home]
        assert any("/p2p-circuit/p2p/" in m for m in reach[home]["maddrs"]), reach[home]
    # how the home workers were connected to each other in their averaged rounds: the circuit
    ids = {n: _log_events(p, "identity")[0]["worker_id"] for n, p in logs.items()}
    paths = [e.get("paths", {}) for e in _log_events(logs["home1-1"], "committed") if e.get("contributors", 0) >= 3]
    assert paths and all(p.get(ids["home2-1"]) == "relay" for p in paths), paths
    assert bed_namespaces("bagelnl-rr-") == []

"""Circuit relay plumbing (protocol/relay.py, worker/reachability.py) without a network: the
multiaddr bytes the Go daemon parses, circuit addresses, which addresses count as publicly
routable, the p2pd flags added to hivemind's, the relay plan a worker derives from the
address it uses towards the coordinator, and the reservation a relay answers (its limits:
which of the daemon's two relay services won its start). The relay itself is exercised on
the network test bed (tests/test_netlab.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from bagel.protocol.messages import Reachability
from bagel.protocol.relay import (
    HOP_STATUS_OK,
    RELAY_DATA_LIMIT_BYTES,
    RELAY_P2PD_ENV,
    RelayAddressError,
    RelayLimit,
    RelayPlan,
    WireMultiaddr,
    circuit_addr,
    dial_addrs,
    hop_reserve_request,
    install_p2pd_args,
    is_publicly_routable,
    p2pd_extra_args,
    parse_hop_status,
    probe_relay_limit,
    public_addrs,
    relay_peer_ids,
    strip_peer,
)
from bagel.protocol.shutdown import descendants
from bagel.worker import reachability

RELAY = "12D3KooWDpGwh8p7xDCgGhGHRVGPtKaw5v2z7mMqSmdhrWEB1Exd"
TARGET = "12D3KooWK6DXCvxHyjw1z5CVaqsct8XULPXsB5t1aCGy4Q7pwtt8"


def test_p2p_components_are_bare_multihashes_as_the_go_daemon_parses_them() -> None:
    mh = PeerID.from_base58(RELAY).to_bytes()
    got = WireMultiaddr(f"/ip4/198.51.100.10/tcp/7071/p2p/{RELAY}/p2p-circuit").to_bytes()
    # ip4 and tcp as hivemind encodes them; /p2p/ = code 421, a length and the multihash; circuit = 290
    assert (
        got == Multiaddr("/ip4/198.51.100.10/tcp/7071").to_bytes() + b"\xa5\x03" + bytes([len(mh)]) + mh + b"\xa2\x02"
    )
    # control: hivemind's own encoding of the same /p2p/ is a CID (two bytes longer), the one p2pd refused
    theirs = Multiaddr(f"/ip4/198.51.100.10/tcp/7071/p2p/{RELAY}").to_bytes()
    assert len(theirs) == len(got) - 2 + 2 and theirs != got[:-2]
    assert WireMultiaddr("/ip6/::1/udp/9/quic-v1").to_bytes() == Multiaddr("/ip6/::1/udp/9/quic-v1").to_bytes()


@pytest.mark.parametrize(
    "bad", ["", "ip4/1.2.3.4", "/ip4/1.2.3.999/tcp/1", "/ip4/1.2.3.4/tcp/70000", "/ip4/1.2.3.4/tcp", "/onion3/x:1"]
)
def test_unencodable_addresses_are_refused_and_left_out_of_a_dial(bad: str) -> None:
    with pytest.raises(RelayAddressError):
        WireMultiaddr(bad)
    assert [str(a) for a in dial_addrs(TARGET, [bad, f"/ip4/1.2.3.4/tcp/5/p2p/{TARGET}"])] == ["/ip4/1.2.3.4/tcp/5"]


def test_circuit_addresses_and_their_dial_form() -> None:
    relay = f"/ip4/198.51.100.10/tcp/7071/p2p/{RELAY}"
    addr = circuit_addr(relay, TARGET)
    assert addr == f"{relay}/p2p-circuit/p2p/{TARGET}"
    assert strip_peer(addr, TARGET) == f"{relay}/p2p-circuit"  # only the trailing target id goes
    assert strip_peer(addr, RELAY) == addr
    assert relay_peer_ids([relay, "/ip4/1.2.3.4/tcp/1"]) == [RELAY]
    for bad in ("/ip4/198.51.100.10/tcp/7071", f"{relay}/p2p-circuit"):
        with pytest.raises(RelayAddressError):
            circuit_addr(bad, TARGET)


@pytest.mark.parametrize(
    ("ip", "public"),
    [("192.168.1.11", False), ("10.1.2.3", False), ("172.20.0.1", False), ("100.64.0.9", False),
     ("127.0.0.1", False), ("169.254.1.1", False), ("::1", False), ("fd00::1", False), ("0.0.0.0", False),
     ("198.51.100.11", True), ("203.0.113.11", True), ("8.8.8.8", True), ("2001:db8::1", True), ("nope", False)],
)  # fmt: skip
def test_publicly_routable_means_no_nat_could_sit_in_front(ip: str, public: bool) -> None:
    assert is_publicly_routable(ip) is public


def test_public_addrs_skip_circuits_and_private_ones() -> None:
    addrs = [f"/ip4/192.168.1.11/tcp/1/p2p/{TARGET}", f"/ip4/198.51.100.10/tcp/7071/p2p/{RELAY}/p2p-circuit",
             "/ip4/198.51.100.11/tcp/2", "/dns4/example.org/tcp/3"]  # fmt: skip
    assert public_addrs(addrs) == ["/ip4/198.51.100.11/tcp/2"]


def test_p2pd_flags_added_only_where_a_relay_is_used_or_served() -> None:
    nat = {"autoRelay": True, "trustedRelays": "/ip4/1.2.3.4/tcp/1/p2p/x", "relay": True}
    assert p2pd_extra_args(nat) == {**nat, "relayDiscovery": False}
    served = p2pd_extra_args({"forceReachabilityPublic": 1, "relay": True})
    assert served["relayService"] is True and served["relayDataLimit"] == RELAY_DATA_LIMIT_BYTES
    plain = {"autoRelay": False, "relay": True, "hostAddrs": "/ip4/0.0.0.0/tcp/0"}
    assert p2pd_extra_args(plain) == plain
    assert p2pd_extra_args({"autoRelay": True}) == {"autoRelay": True}  # discovery without static relays
    install_p2pd_args()
    install_p2pd_args()  # idempotent: one wrapper
    argv = P2P._make_process_args("p2pd", autoRelay=True, trustedRelays="/ip4/1.2.3.4/tcp/1/p2p/x")
    assert argv.count("-relayDiscovery=0") == 1 and argv[0] == "p2pd"


def test_the_relay_plan_follows_the_address_used_towards_the_coordinator(monkeypatch: pytest.MonkeyPatch) -> None:
    peers = [f"/ip4/198.51.100.10/tcp/7071/p2p/{RELAY}"]
    for src, relays in (("192.168.1.11", tuple(peers)), ("198.51.100.11", ()), ("127.0.0.1", ()), (None, tuple(peers))):
        monkeypatch.setattr(reachability, "source_ip", lambda _peers, src=src: src)
        got, seen = reachability.plan(False, peers)
        assert (got.relays, got.serve, seen) == (relays, False, src)
    assert reachability.plan(True, peers)[0] == RelayPlan(serve=True)
    kw = RelayPlan(relays=tuple(peers)).dht_kwargs()
    assert kw["use_auto_relay"] and kw["force_reachability"] == "private" and kw["trusted_relays"] == peers
    assert RelayPlan(serve=True).dht_kwargs()["force_reachability"] == "public"
    assert RelayPlan().dht_kwargs() == {}


def test_source_ip_is_the_routing_tables_choice() -> None:
    assert reachability.source_ip(["/dns4/x/tcp/1", "/ip4/127.0.0.1/tcp/9/p2p/x"]) == "127.0.0.1"
    assert reachability.source_ip(["/dns4/x/tcp/1"]) is None


class _Peer:
    def __init__(self, pid: str) -> None:
        self.peer_id = PeerID.from_base58(pid)


class _FakeDaemon:
    """The two daemon calls `probe` makes (a stand-in: the real daemon is tested on the bed)."""

    def __init__(self, peers: list[str]) -> None:
        self.peers = peers

    async def list_peers(self) -> list[_Peer]:
        return [_Peer(p) for p in self.peers]


class _FakeP2P:
    def __init__(self, peers: list[str]) -> None:
        self.peer_id = PeerID.from_base58(TARGET)
        self._client = _FakeDaemon(peers)

    async def get_visible_maddrs(self, latest: bool = False) -> list[str]:
        return [f"/ip4/192.168.1.11/tcp/5/p2p/{TARGET}"]


async def test_probe_reports_relayed_only_with_a_live_relay_connection() -> None:
    relay = f"/ip4/198.51.100.10/tcp/7071/p2p/{RELAY}"
    plan = RelayPlan(relays=(relay,))
    got = await reachability.probe(_FakeP2P([RELAY]), plan, "192.168.1.11", wait_s=0.1)
    assert got.kind == Reachability.RELAYED and got.relays == (RELAY,)
    assert got.maddrs[-1] == circuit_addr(relay, TARGET) and RELAY[-8:] in got.detail
    lost = await reachability.probe(_FakeP2P([]), plan, "192.168.1.11", wait_s=0.1)
    assert lost.kind == Reachability.UNREACHABLE and "no connection to a relay" in lost.detail
    assert not any("p2p-circuit" in m for m in lost.maddrs)
    alone = await reachability.probe(_FakeP2P([]), RelayPlan(), "192.168.1.11", wait_s=0.1)
    assert alone.kind == Reachability.UNREACHABLE and "no relay was given" in alone.detail
    public = await reachability.probe(_FakeP2P([]), RelayPlan(), "198.51.100.11", wait_s=0.1)
    assert public.kind == Reachability.DIRECT and "198.51.100.11" in public.detail


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _status(status: int, duration: int | None, data: int | None) -> bytes:
    """A relay's HopMessage{type: STATUS, reservation, limit, status} as go-libp2p writes it."""
    limit = b""
    if duration is not None:
        limit += b"\x08" + _varint(duration)
    if data is not None:
        limit += b"\x10" + _varint(data)
    reservation = b"\x08" + _varint(1_800_000_000)  # expire; the relay's addresses left out
    body = b"\x08\x02" + b"\x1a" + _varint(len(reservation)) + reservation
    if duration is not None or data is not None:
        body += b"\x22" + _varint(len(limit)) + limit
    return body + b"\x28" + _varint(status)


def test_a_reservation_answer_says_which_relay_service_serves() -> None:
    assert hop_reserve_request() == b"\x02\x08\x00"  # length 2, type = RESERVE
    ours = parse_hop_status(_status(HOP_STATUS_OK, 7200, RELAY_DATA_LIMIT_BYTES))
    assert ours == RelayLimit(HOP_STATUS_OK, 7200, RELAY_DATA_LIMIT_BYTES) and ours.is_ours()
    # go-libp2p's defaults, which the daemon's second relay service runs with: 2 min, 128 KiB
    defaults = parse_hop_status(_status(HOP_STATUS_OK, 120, 131072))
    assert defaults.data_bytes == 131072 and not defaults.is_ours()
    assert not parse_hop_status(_status(HOP_STATUS_OK, None, None)).is_ours()  # no limit given
    assert not parse_hop_status(_status(200, 7200, RELAY_DATA_LIMIT_BYTES)).is_ours()  # refused


@pytest.mark.parametrize(
    "bad",
    [b"", b"\x08\x00", b"\x08\x02\x22\x09\x08", b"\x08\x02\x0d\x00\x00\x00\x00", b"\x08\xff\xff"],
)
def test_a_malformed_relay_answer_is_refused(bad: bytes) -> None:
    with pytest.raises(RelayAddressError):
        parse_hop_status(bad)


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command name of every live process below `pid` (`bagel.protocol.shutdown.descendants`)."""
    out: dict[int, str] = {}
    for child in descendants(pid):
        try:
            out[child] = Path(f"/proc/{child}/comm").read_text().strip()
        except OSError:
            continue  # exited since the scan
    return out


@pytest.mark.timeout(120)
async def test_a_relay_node_serves_with_our_limits_from_a_daemon_with_one_go_processor() -> None:
    """The daemon runs two relay services and the last to register serves; with one Go processor
    (RELAY_P2PD_ENV) ours registers last (`bagel.protocol.relay`). `start_relay_dht` hands that
    environment to the node's daemon alone and keeps the node only once a reservation is
    answered with our limits (the defaults cut every relayed connection after 128 KiB)."""
    import asyncio

    from bagel.protocol.discovery import start_relay_dht

    install_p2pd_args()
    dht = await asyncio.to_thread(
        start_relay_dht, host_maddrs=["/ip4/127.0.0.1/tcp/0"], **RelayPlan(serve=True).dht_kwargs()
    )
    try:
        got = await probe_relay_limit(dht.peer_id.to_base58(), [str(m) for m in dht.get_visible_maddrs()])
        assert got.is_ours(), got
        assert got.duration_s == 7200
        daemons = [p for p, name in _descendants(dht.pid).items() if name == "p2pd"]
        assert len(daemons) == 1, _descendants(dht.pid)
        env = Path(f"/proc/{daemons[0]}/environ").read_bytes().split(b"\0")
        assert all(f"{k}={v}".encode() in env for k, v in RELAY_P2PD_ENV.items())
        assert "GOMAXPROCS" not in os.environ  # this process (and any other daemon it starts) is left as it was
    finally:
        await asyncio.to_thread(dht.shutdown)


@pytest.mark.timeout(120)
async def test_a_relay_node_whose_relay_answers_other_limits_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A node that is not forced public never starts go-libp2p's relay service (it waits for
    AutoNAT), so only the daemon's default-limit one answers: `start_relay_dht` starts it
    again, then refuses it with RelayLimitError naming the limits, and leaves no process."""
    import asyncio

    from bagel.protocol.discovery import RelayLimitError, start_relay_dht

    install_p2pd_args()
    before = set(_descendants(os.getpid()))
    refused = pytest.raises(RelayLimitError, match=r"131072 bytes and 120 s per relayed connection .* in 2 starts")
    with caplog.at_level(logging.WARNING, logger="bagel.protocol.discovery"), refused:
        await asyncio.to_thread(start_relay_dht, attempts=2, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=True)
    assert sum("starting it again (2 of 2)" in r.getMessage() for r in caplog.records) == 1
    # `serve` says it in one line, exit 1, with what to do
    from bagel.coordinator.cli import _serve_failure

    line = _serve_failure(RelayLimitError("limits"), Path("/nonexistent"))
    assert type(line).__name__ == "RuntimeFailure" and str(line).endswith("limits; start serve again")
    for _ in range(50):  # the DHT child and its daemon exit within a few seconds of shutdown
        left = {p: n for p, n in _descendants(os.getpid()).items() if p not in before}
        if not left:
            break
        await asyncio.sleep(0.1)
    assert not left, left

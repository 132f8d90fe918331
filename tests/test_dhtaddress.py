"""The DHT node's stable address (`bagel.protocol.dhtaddress`): the DHT port next to the gRPC
port, `--announce` checks, the join string's peer list in a fixed order, the loopback
check, and the persisted libp2p identity. No processes: the functions alone."""

from __future__ import annotations

import itertools
import os
import stat
from pathlib import Path

import pytest

from bagel.protocol.dhtaddress import (
    AddressError,
    check_announce,
    check_listen,
    dht_listen_for,
    host_of,
    join_peers,
    load_or_create_identity,
    loopback_only,
    node_id_for,
)

PEER = "QmU6dnqiXAcpgZD6rUVDfy74PoDQgN8VwFsYUztkE8bDK6"
OTHER = "/ip4/198.51.100.4/tcp/4001/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1:7070", "/ip4/127.0.0.1/tcp/7071"),
        ("0.0.0.0:7070", "/ip4/0.0.0.0/tcp/7071"),
        (":7070", "/ip4/0.0.0.0/tcp/7071"),
        ("[::]:7070", "/ip6/::/tcp/7071"),
        ("127.0.0.1:0", "/ip4/127.0.0.1/tcp/0"),  # a free port for each (tests)
        ("localhost:9000", "/ip4/127.0.0.1/tcp/9001"),
    ],
)
def test_the_dht_listens_where_grpc_does_on_the_next_port(listen: str, expected: str) -> None:
    assert dht_listen_for(listen) == expected
    assert check_listen(expected) == expected


@pytest.mark.parametrize("listen", ["localhost", "0.0.0.0:65535", "0.0.0.0:99999", "no-such-host.invalid:7070"])
def test_a_listen_address_without_room_for_the_dht_is_refused(listen: str) -> None:
    with pytest.raises(AddressError, match="--listen"):
        dht_listen_for(listen)


def test_announce_addresses_are_checked_and_kept_in_order() -> None:
    good = ["/dns4/coord.example.org/tcp/7071", "/ip4/203.0.113.7/tcp/7071", "/ip4/203.0.113.7/tcp/7071"]
    assert check_announce(good) == ("/dns4/coord.example.org/tcp/7071", "/ip4/203.0.113.7/tcp/7071")
    for bad, why in [
        ("/ip4/203.0.113.7/tcp/0", "explicit port"),
        ("/ip4/203.0.113.7", "explicit port"),
        ("/tcp/7071", "must start with"),
        (f"/ip4/203.0.113.7/tcp/7071/p2p/{PEER}", "leave out /p2p"),
        ("203.0.113.7:7071", "not a multiaddr"),
    ]:
        with pytest.raises(AddressError, match=why):
            check_announce([bad])
    with pytest.raises(AddressError, match="at most"):
        check_announce([f"/ip4/203.0.113.{i}/tcp/7071" for i in range(1, 10)])


def test_join_peers_are_the_announced_addresses_in_the_given_order() -> None:
    announce = ["/ip4/203.0.113.7/tcp/7071", "/dns4/coord.example.org/tcp/7071"]
    visible = [f"/ip4/127.0.0.1/tcp/7071/p2p/{PEER}"]
    peers = join_peers(PEER, visible, announce=announce, listen_port=7071, extra=[OTHER])
    assert peers == (*(f"{a}/p2p/{PEER}" for a in announce), OTHER)
    assert not loopback_only(peers)


def test_join_peers_from_the_daemon_are_filtered_and_sorted_the_same_whatever_their_order() -> None:
    visible = [
        f"/ip4/127.0.0.1/tcp/7071/p2p/{PEER}",
        f"/ip6/2001:db8::5/tcp/7071/p2p/{PEER}",
        f"/ip4/192.0.2.2/tcp/7071/p2p/{PEER}",
        f"/ip4/198.51.100.9/tcp/40123/p2p/{PEER}",  # observed on another port: transient
        f"/ip4/198.51.100.4/tcp/7071/p2p/{PEER}/p2p-circuit",  # relayed
        f"/ip4/192.0.2.2/tcp/7071/p2p/{PEER}",
    ]
    expected = (
        f"/ip4/192.0.2.2/tcp/7071/p2p/{PEER}",
        f"/ip6/2001:db8::5/tcp/7071/p2p/{PEER}",
    )
    for order in itertools.permutations(visible):
        assert join_peers(PEER, order, listen_port=7071) == expected
    # loopback only when nothing else is there, and then the join string is flagged
    local = join_peers(PEER, visible[:1], listen_port=7071)
    assert local == (f"/ip4/127.0.0.1/tcp/7071/p2p/{PEER}",)
    assert loopback_only(local)
    assert loopback_only((f"/ip6/::1/tcp/7071/p2p/{PEER}", f"/dns4/localhost/tcp/7071/p2p/{PEER}"))
    assert not loopback_only(())
    assert host_of(expected[1]) == "2001:db8::5"
    # capped at the join string's limit, own addresses first
    many = [f"/ip4/192.0.2.{i}/tcp/7071/p2p/{PEER}" for i in range(1, 30)]
    assert len(join_peers(PEER, many, listen_port=7071, extra=[OTHER])) == 16


def test_the_identity_is_created_once_0600_and_read_back(tmp_path: Path) -> None:
    key = tmp_path / "dht.key"
    peer = load_or_create_identity(key)
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert peer.startswith("Qm")
    data = key.read_bytes()
    assert load_or_create_identity(key) == peer and key.read_bytes() == data
    assert node_id_for(peer) == node_id_for(peer) != node_id_for(OTHER.rsplit("/", 1)[1])
    assert [p.name for p in tmp_path.iterdir()] == ["dht.key"]  # no temp file left behind


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_damaged_identity_is_refused_with_what_to_do(tmp_path: Path, damage: str) -> None:
    key = tmp_path / "dht.key"
    load_or_create_identity(key)
    data = key.read_bytes()
    key.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(64), "empty": b""}[damage])
    with pytest.raises(AddressError, match="delete it to make a new DHT identity"):
        load_or_create_identity(key)


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--announce", "/ip4/203.0.113.7/tcp/0"], "explicit port"),
        (["--announce", "203.0.113.7:7071"], "not a multiaddr"),
        (["--listen", "0.0.0.0:65535"], "no room for the DHT port"),
        (["--dht-listen", "0.0.0.0:7071"], "not a multiaddr"),
        (["--dht-listen", "/dns4/example.org/tcp/7071"], "expected /ip4/HOST/tcp/PORT"),
    ],
)
def test_serve_refuses_bad_addresses_with_one_line_before_touching_the_data_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], why: str
) -> None:
    from bagel.coordinator.cli import main

    spec = Path(__file__).parent.parent / "examples" / "digits-2x2.toml"
    data = tmp_path / "d"
    assert main(["serve", "--run", str(spec), "--data-dir", str(data), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and why in err[0], err
    assert not data.exists()

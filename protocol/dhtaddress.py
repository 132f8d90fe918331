"""A DHT node's stable address: its persisted libp2p identity, its listen and announce
multiaddrs, and the peer list a join string carries.

A join string must survive a coordinator restart byte for byte, so every part of the
peer list is a function of the data dir and the flags, never of chance:

- the peer id comes from a libp2p private key kept in the data dir (`dht.key`, created
  once, atomically, in the format hivemind's `P2P.generate_identity` writes: an RSA key in
  libp2p's `PrivateKey` protobuf, which hivemind's own identity check can read);
- the port is fixed: by default the gRPC port + 1 (`7071` next to the default `7070`), on
  the host `--listen` names, so `serve --listen 0.0.0.0:7070` is reachable off loopback;
- the addresses are the operator's `--announce` multiaddrs in the order given, or else
  the ones the p2p daemon reports for the listen port, filtered and sorted (`join_peers`);
- the DHT routing id is derived from the peer id (`node_id_for`), so the node keeps its
  place in the DHT's key space across restarts.

Nothing here starts a process; `bagel.protocol.discovery.start_dht` takes the results.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bagel.protocol.atomicfile import atomic_write

DHT_KEY_FILE = "dht.key"
DHT_PORT_OFFSET = 1  # the default DHT port is the gRPC port + 1: 7070 -> 7071
MAX_KEY_FILE_BYTES = 16384  # an RSA-2048 libp2p key is ~1.2 kB
MAX_ANNOUNCE = 8
_ADDR_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


class AddressError(ValueError):
    """A listen or announce address, or the DHT key file, cannot be used; the message says why."""


# ---------------------------------------------------------------------------- identity


def peer_id_of_key(data: bytes) -> str:
    """The base58 peer id of a libp2p private key file's bytes; AddressError if it is none."""
    from hivemind.p2p import PeerID

    if not data or len(data) > MAX_KEY_FILE_BYTES:
        raise AddressError(f"not a libp2p private key ({len(data)} bytes)")
    try:
        return str(PeerID.from_identity(data).to_base58())
    except Exception:  # protobuf and DER parsing raise several types on garbage
        raise AddressError("not a libp2p private key (truncated or corrupt?)") from None


def load_or_create_identity(path: Path) -> str:
    """Make sure `path` holds a libp2p private key (created on first use); return its peer id.

    hivemind would create the file itself, but not atomically: a crash in the middle would
    leave a torn key, and the next start a p2p daemon that refuses it. Here it is written
    through `atomic_write` (a 0600 temp file, fsync, rename).
    """
    if not path.exists():
        from hivemind.proto import crypto_pb2
        from hivemind.utils.crypto import RSAPrivateKey

        key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
        atomic_write(path, key.SerializeToString())
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise AddressError(f"{path}: cannot read the DHT identity: {e.strerror or e}") from None
    try:
        return peer_id_of_key(data)
    except AddressError as e:
        raise AddressError(
            f"{path}: {e}; delete it to make a new DHT identity (the join string then changes)"
        ) from None


def node_id_for(peer_id: str) -> Any:
    """The hivemind DHTID of a node with this peer id: the same on every start."""
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=f"bagel/dht-node/{peer_id}".encode())


# ---------------------------------------------------------------------------- listen and announce


def _split_host_port(listen: str) -> tuple[str, int]:
    host, sep, port_s = listen.rpartition(":")
    if not sep or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise AddressError(f"--listen {listen!r}: expected HOST:PORT, e.g. 0.0.0.0:7070")
    return host.strip("[]"), int(port_s)


def dht_listen_for(listen: str) -> str:
    """The DHT listen multiaddr next to the gRPC `listen` address (HOST:PORT): the same host,
    port + 1 (port 0 stays 0, a free port). A host name is resolved to its IPv4 address."""
    host, port = _split_host_port(listen)
    dht_port = port + DHT_PORT_OFFSET if port else 0
    if dht_port > 65535:
        raise AddressError(f"--listen {listen!r}: port {port} leaves no room for the DHT port; give --dht-listen")
    if host in ("", "0.0.0.0"):
        return f"/ip4/0.0.0.0/tcp/{dht_port}"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
        except (OSError, IndexError, ValueError):
            raise AddressError(f"--listen {listen!r}: cannot resolve {host!r}") from None
    return f"/ip{ip.version}/{ip}/tcp/{dht_port}"


def check_listen(maddr: str) -> str:
    """Validate a `--dht-listen` multiaddr: /ip4 or /ip6, then /tcp/PORT (0 = a free port)."""
    try:
        names = [name for name, _ in _components(maddr)]
    except AddressError as e:
        raise AddressError(f"--dht-listen {e}") from None
    if len(names) < 2 or names[0] not in ("ip4", "ip6") or names[1] != "tcp":
        raise AddressError(f"--dht-listen {maddr!r}: expected /ip4/HOST/tcp/PORT or /ip6/HOST/tcp/PORT")
    return maddr


def _components(maddr: str) -> list[tuple[str, str]]:
    from hivemind.utils.multiaddr import Multiaddr

    try:
        parsed = Multiaddr(maddr)
        return [(proto.name, str(parsed.value_for_protocol(proto.code) or "")) for proto in parsed.protocols()]
    except Exception:  # the multiaddr package raises several types on garbage
        raise AddressError(f"{maddr[:120]!r} is not a multiaddr (e.g. /ip4/203.0.113.7/tcp/7071)") from None


def port_of(maddr: str) -> int:
    """The tcp (or udp) port a multiaddr names; 0 if none."""
    for name, value in _components(maddr):
        if name in ("tcp", "udp"):
            return int(value)
    return 0


def check_announce(maddrs: Iterable[str]) -> tuple[str, ...]:
    """Validate `--announce` multiaddrs: a host part (ip4/ip6/dns*), an explicit nonzero port,
    no /p2p/ part (the node's own peer id is appended); at most MAX_ANNOUNCE, no repeats."""
    out: list[str] = []
    for maddr in maddrs:
        maddr = maddr.strip()
        try:
            parts = _components(maddr)
        except AddressError as e:
            raise AddressError(f"--announce {e}") from None
        names = [name for name, _ in parts]
        if not names or names[0] not in _ADDR_PROTOCOLS:
            raise AddressError(f"--announce {maddr!r}: must start with /ip4, /ip6 or /dns*")
        if "p2p" in names or "p2p-circuit" in names:
            raise AddressError(f"--announce {maddr!r}: leave out /p2p/...; the coordinator's peer id is added")
        if port_of(maddr) == 0:
            raise AddressError(f"--announce {maddr!r}: needs an explicit port, e.g. /tcp/7071")
        if maddr not in out:
            out.append(maddr)
    if len(out) > MAX_ANNOUNCE:
        raise AddressError(f"--announce: at most {MAX_ANNOUNCE} addresses")
    return tuple(out)


# ---------------------------------------------------------------------------- the join string's peers


def is_loopback(maddr: str) -> bool:
    """True for a multiaddr whose host is a loopback address (127.0.0.0/8, ::1, localhost)."""
    for name, value in _components(maddr):
        if name in ("ip4", "ip6"):
            return ipaddress.ip_address(value).is_loopback
        if name in ("dns", "dns4", "dns6"):
            return value.lower() == "localhost" or value.lower().endswith(".localhost")
    return False


def host_of(maddr: str) -> str:
    """The host a multiaddr names (an IP address or DNS name); "" if it names none."""
    for name, value in _components(maddr):
        if name in _ADDR_PROTOCOLS:
            return value
    return ""


def loopback_only(peers: Sequence[str]) -> bool:
    """True if every peer of a join string is on loopback: no other machine can use it."""
    return bool(peers) and all(is_loopback(p) for p in peers)


def _strip_p2p(maddr: str) -> str:
    head, sep, _ = maddr.partition("/p2p/")
    return head if sep else maddr


def _order(maddr: str) -> tuple[bool, bool, str]:
    ip6 = maddr.startswith("/ip6/") or maddr.startswith("/dns6/")
    return is_loopback(maddr), ip6, maddr


def join_peers(
    peer_id: str,
    visible: Iterable[str],
    *,
    announce: Sequence[str] = (),
    listen_port: int = 0,
    extra: Sequence[str] = (),
    limit: int = 16,
) -> tuple[str, ...]:
    """The bootstrap peers a join string names, the same on every start with the same flags.

    `announce` (if any) in the given order; else the daemon's `visible` addresses for our
    `listen_port` (when fixed; addresses on other ports are observed or transient), relayed
    ones dropped, loopback dropped when another remains, sorted (routable first, IPv4
    first, then by text); each with `/p2p/<peer_id>`. Then `extra`, the DHT peers the node
    bootstrapped from (full multiaddrs), so a worker can bootstrap through them too.
    """
    if announce:
        own = [_strip_p2p(m) for m in announce]
    else:
        own = []
        for maddr in visible:
            if "/p2p-circuit" in str(maddr):
                continue
            bare = _strip_p2p(str(maddr))
            if listen_port and port_of(bare) != listen_port:
                continue
            if bare not in own:
                own.append(bare)
        if any(not is_loopback(m) for m in own):
            own = [m for m in own if not is_loopback(m)]
        own.sort(key=_order)
    peers = [f"{m}/p2p/{peer_id}" for m in own]
    for maddr in extra:
        if maddr not in peers:
            peers.append(maddr)
    return tuple(peers[:limit])

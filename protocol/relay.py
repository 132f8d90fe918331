"""libp2p circuit relay (v2) through publicly reachable peers, as hivemind 1.1.12's p2pd runs it.

A volunteer behind a NAT accepts no inbound connection. It can still be reached through a
relay: a public peer it keeps a connection to, at which it holds a reservation; a peer that
wants it dials `/ip4/R/tcp/P/p2p/RELAY/p2p-circuit/p2p/TARGET`, and the relay splices the
two connections (end-to-end encrypted: the relay sees only ciphertext). See
https://github.com/libp2p/specs/blob/master/relay/circuit-v2.md. What it takes with this
hivemind version, each found on the network test bed (sim/netlab/):

- the NAT'd side: `use_auto_relay=True` with the relays as `trusted_relays`, and
  `force_reachability="private"` so autorelay starts at once instead of waiting for AutoNAT.
  hivemind passes no `-relayDiscovery=0`, and with discovery on, go-libp2p's autorelay waits
  for 4 candidates or a 3 minute boot delay before it reserves; with the static relay list
  (`relayDiscovery=0`) it reserves within milliseconds. `p2pd_extra_args` adds the flag.
- the relay: `force_reachability="public"` (the relay service starts only on a host that
  believes it is public) and explicit `-relayService=1 -relayDataLimit=... -relayTimeLimit=...`:
  without them the daemon ran the relay with go-libp2p's default limit of 128 KiB per
  relayed connection (measured: it reset the stream at exactly 131072 bytes), far below a
  pseudo-gradient part.
- the address: go-libp2p drops a relay's address from its own advertised circuit addresses
  unless it is a globally routable one (the test bed's documentation ranges are not), so the
  worker builds its circuit addresses itself from the relays it was given.
- the encoding: hivemind's multiaddr encodes a `/p2p/` component as a CIDv1 while the Go
  daemon wants the bare multihash ("length greater than remaining number of bytes in
  buffer"); `WireMultiaddr` gives the daemon the bytes it parses.

- two relay services: on a relay node the daemon runs two relay v2 services, and no flag
  turns either off alone (learning-at-home/go-libp2p-daemon v0.5.0.hivemind1, the source of
  hivemind 1.1.12's p2pd). `p2pd/main.go` adds go-libp2p's service, with the limits above,
  through `ConfigureRelayService` (`relay.go`) under `-relay` and `-relayService`, and then,
  under `-relay` alone, calls `Daemon.EnableRelayV2()` (`daemon.go`), which is
  `relay.New(host)` with go-libp2p's defaults (128 KiB and 2 minutes per relayed
  connection). `-relay=false` cannot be given at all: main.go only ever sets the config's
  Relay.Enabled to true, and its default is true. Both services register the hop protocol
  with `SetStreamHandler`, and the last registration serves. The daemon's runs synchronously
  in main, before the control socket is served. go-libp2p's (v0.32.1) is started by
  `p2p/host/relaysvc.RelayManager` in a goroutine of its own, when it receives the
  "reachability public" event that `-forceReachabilityPublic` makes AutoNAT emit inside
  `libp2p.New`, before the daemon's registers. With several Go processors that goroutine
  usually runs at once, registers first and loses: measured here (`bench/relay_starts.py`,
  this 2-core host at a load average of 6-11), the defaults served in 16 of 30 starts, and
  in all 8 starts, twice, of the coordinator in `bench/netlab_rounds.py`. With one Go
  processor (`GOMAXPROCS=1`, `RELAY_P2PD_ENV`) it runs only when main's goroutine yields,
  and main's path from that event to `EnableRelayV2` waits on nothing, so ours usually
  registers last: our limits served in 79 of 80 starts (same host and loads; the one loss
  at a load of 11). Not always, because the Go scheduler can still run it earlier (it
  preempts a goroutine that ran 10 ms straight, hands a processor on when a thread stays in
  a system call, stops goroutines for the garbage collector). So a relay node asks itself
  for a reservation from a throwaway peer (`probe_relay_limit`) and starts again, up to 3
  starts, if the answer carries other limits; then it refuses to start
  (`bagel.protocol.discovery.start_relay_dht`).

Hole punching (DCUtR) is on wherever AutoNAT is (hivemind's default `auto_nat=True`); it
needs a peer's observed public addresses, which libp2p confirms only after several
observers, so on a small swarm the relayed connection is what carries the exchange.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import base58

# Relayed connections carry whole exchanges (pseudo-gradient parts of many MB), so the relay's
# per-connection limits are those of a data path, not go-libp2p's 128 KiB / 2 min defaults.
RELAY_DATA_LIMIT_BYTES = 1 << 34
RELAY_TIME_LIMIT = "2h0m0s"
RELAY_MAX_CIRCUITS = 64
# The environment of a relay node's p2p daemon: one Go processor, so go-libp2p's relay service
# (ours) registers after the daemon's default-limit one ("two relay services" above). One core
# still relays far more than a volunteer's link carries.
RELAY_P2PD_ENV = {"GOMAXPROCS": "1"}

# Address ranges from which a host accepts no connection from the internet as is: RFC 1918,
# carrier-grade NAT (RFC 6598), loopback and link-local. Documentation ranges (RFC 5737) are
# treated as public, since the test bed's public segment uses them.
_UNREACHABLE = [
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "0.0.0.0/8",
        "::1/128",
        "fe80::/10",
        "fc00::/7",
        "::/128",
    )
]

_P_IP4, _P_TCP, _P_UDP, _P_IP6, _P_DNS4, _P_DNS6, _P_DNS = 4, 6, 273, 41, 54, 55, 53
_P_P2P, _P_CIRCUIT, _P_QUIC_V1 = 421, 290, 461


class RelayAddressError(ValueError):
    """A multiaddr this module cannot encode for the daemon."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class WireMultiaddr:
    """A multiaddr in the binary form the Go daemon parses (`/p2p/` as a bare multihash).

    Duck-types the one method hivemind's daemon client calls on an address (`to_bytes`).
    Supports ip4, ip6, dns, dns4, dns6, tcp, udp, quic-v1, p2p and p2p-circuit."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._bytes = self._encode(text)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"WireMultiaddr({self.text!r})"

    def to_bytes(self) -> bytes:
        return self._bytes

    @staticmethod
    def _encode(text: str) -> bytes:
        parts = text.strip("/").split("/")
        if not text.startswith("/") or not parts or parts == [""]:
            raise RelayAddressError(f"not a multiaddr: {text!r}")
        out, i = bytearray(), 0
        try:
            while i < len(parts):
                name = parts[i]
                if name == "p2p-circuit":
                    out += _varint(_P_CIRCUIT)
                    i += 1
                    continue
                if name == "quic-v1":
                    out += _varint(_P_QUIC_V1)
                    i += 1
                    continue
                if i + 1 >= len(parts):
                    raise RelayAddressError(f"{text!r}: /{name} needs a value")
                value = parts[i + 1]
                if name == "ip4":
                    out += _varint(_P_IP4) + ipaddress.IPv4Address(value).packed
                elif name == "ip6":
                    out += _varint(_P_IP6) + ipaddress.IPv6Address(value).packed
                elif name in ("tcp", "udp"):
                    port = int(value)
                    if not 0 <= port <= 65535:
                        raise RelayAddressError(f"{text!r}: port {value}")
                    out += _varint(_P_TCP if name == "tcp" else _P_UDP) + port.to_bytes(2, "big")
                elif name in ("dns", "dns4", "dns6"):
                    raw = value.encode()
                    code = {"dns": _P_DNS, "dns4": _P_DNS4, "dns6": _P_DNS6}[name]
                    out += _varint(code) + _varint(len(raw)) + raw
                elif name in ("p2p", "ipfs"):
                    mh = base58.b58decode(value)
                    if not 2 <= len(mh) <= 64:
                        raise RelayAddressError(f"{text!r}: peer id of {len(mh)} bytes")
                    out += _varint(_P_P2P) + _varint(len(mh)) + mh
                else:
                    raise RelayAddressError(f"{text!r}: protocol /{name} not supported")
                i += 2
        except (ValueError, KeyError) as e:
            if isinstance(e, RelayAddressError):
                raise
            raise RelayAddressError(f"{text!r}: {e}") from e
        return bytes(out)


def strip_peer(maddr: str, peer_id: str) -> str:
    """`maddr` without its trailing `/p2p/<peer_id>` (the daemon takes the id separately)."""
    tail = f"/p2p/{peer_id}"
    return maddr[: -len(tail)] if maddr.endswith(tail) else maddr


def dial_addrs(peer_id: str, maddrs: Iterable[str]) -> list[WireMultiaddr]:
    """The addresses to hand the daemon's CONNECT for `peer_id`, direct and circuit alike;
    ones this module cannot encode are left out (the others may still work)."""
    out = []
    for a in maddrs:
        try:
            out.append(WireMultiaddr(strip_peer(a, peer_id)))
        except RelayAddressError:
            continue
    return out


def circuit_addr(relay_maddr: str, target_peer_id: str) -> str:
    """The address of `target_peer_id` through the relay at `relay_maddr` (which ends in /p2p/RELAY)."""
    if "/p2p/" not in relay_maddr or "p2p-circuit" in relay_maddr:
        raise RelayAddressError(f"a relay address ends in /p2p/<relay id>: {relay_maddr!r}")
    return f"{relay_maddr}/p2p-circuit/p2p/{target_peer_id}"


def is_circuit(maddr: str) -> bool:
    return "/p2p-circuit" in maddr


def host_ip(maddr: str) -> str | None:
    """The IP address of an /ip4 or /ip6 multiaddr, else None."""
    parts = maddr.strip("/").split("/")
    if len(parts) >= 2 and parts[0] in ("ip4", "ip6"):
        return parts[1]
    return None


def is_publicly_routable(ip: str) -> bool:
    """Whether a connection from the internet could reach this address as is (no NAT in between)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if addr.is_unspecified or addr.is_multicast:
        return False
    return not any(addr in net for net in _UNREACHABLE if net.version == addr.version)


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def public_addrs(maddrs: Iterable[str]) -> list[str]:
    """The direct (non-circuit) addresses whose IP is publicly routable."""
    out = []
    for m in maddrs:
        ip = host_ip(m)
        if ip is not None and not is_circuit(m) and is_publicly_routable(ip):
            out.append(m)
    return out


@dataclass(frozen=True)
class RelayPlan:
    """How this node's p2p daemon uses relays: as a NAT'd client of `relays`, or serving as one."""

    relays: tuple[str, ...] = ()  # reserve at these (NAT'd side)
    serve: bool = False  # run the relay service for others (a public node)

    def dht_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `hivemind.DHT` / `P2P.create`."""
        if self.serve:
            return {"force_reachability": "public", "use_relay": True}
        if self.relays:
            return {
                "use_relay": True,
                "use_auto_relay": True,
                "force_reachability": "private",
                "trusted_relays": list(self.relays),
                "client_mode": True,  # a NAT'd node cannot answer DHT requests others send it directly
            }
        return {}


def p2pd_extra_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The p2pd flags hivemind's `P2P.create` does not expose, added to its own (see the module
    docstring): static relays for a NAT'd node, a relay service with data-path limits for a
    node forced public."""
    out = dict(kwargs)
    if out.get("trustedRelays") and out.get("autoRelay"):
        out["relayDiscovery"] = False
    if out.get("forceReachabilityPublic") and out.get("relay", True):
        out["relayService"] = True
        out["relayDataLimit"] = RELAY_DATA_LIMIT_BYTES
        out["relayTimeLimit"] = RELAY_TIME_LIMIT
        out["relayMaxCircuits"] = RELAY_MAX_CIRCUITS
    return out


_installed = False


def install_p2pd_args() -> None:
    """Route hivemind's p2pd command line through `p2pd_extra_args` (idempotent).

    hivemind builds the daemon's argv in the static `P2P._make_process_args(*args, **kwargs)`;
    wrapping it is the one place these flags can be added without forking hivemind. Daemons
    without trusted relays or forced public reachability get exactly hivemind's argv."""
    global _installed
    if _installed:
        return
    from hivemind.p2p import P2P

    original = P2P._make_process_args

    def make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        return list(original(*args, **p2pd_extra_args(kwargs)))

    P2P._make_process_args = staticmethod(make_process_args)
    _installed = True


# ---------------------------------------------------------------------------- what a relay answers

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
_HOP_RESERVE = 0  # HopMessage.Type.RESERVE
_HOP_STATUS = 2  # HopMessage.Type.STATUS
HOP_STATUS_OK = 100
MAX_HOP_MESSAGE_BYTES = 4096  # a STATUS with a reservation is a few hundred bytes


@dataclass(frozen=True)
class RelayLimit:
    """What a relay answered to a reservation: its status and the limits it puts on every
    relayed connection (seconds, bytes in each direction; 0 = none given)."""

    status: int
    duration_s: int = 0
    data_bytes: int = 0

    def is_ours(self) -> bool:
        """Whether the relay is the one configured with `RELAY_DATA_LIMIT_BYTES` (see "two relay
        services" in the module docstring); go-libp2p's defaults answer 131072 bytes."""
        return self.status == HOP_STATUS_OK and self.data_bytes >= RELAY_DATA_LIMIT_BYTES


def hop_reserve_request() -> bytes:
    """A circuit v2 `HopMessage{type: RESERVE}`, length-prefixed as on the wire."""
    body = _varint((1 << 3) | 0) + _varint(_HOP_RESERVE)
    return _varint(len(body)) + body


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise RelayAddressError("truncated or oversized varint in a relay message")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _pb_fields(buf: bytes) -> dict[int, int | bytes]:
    """The first value of each field of a protobuf message (varint and length-delimited only)."""
    out: dict[int, int | bytes] = {}
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        field, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 2:
            n, i = _read_varint(buf, i)
            if i + n > len(buf):
                raise RelayAddressError("a relay message field runs past its end")
            value, i = buf[i : i + n], i + n
        else:
            raise RelayAddressError(f"unexpected protobuf wire type {wire} in a relay message")
        out.setdefault(field, value)
    return out


def parse_hop_status(body: bytes) -> RelayLimit:
    """A relay's `HopMessage` (without its length prefix) as a `RelayLimit`; RelayAddressError
    if it is not a STATUS."""
    f = _pb_fields(body)
    if f.get(1) != _HOP_STATUS or not isinstance(f.get(5, 0), int):
        raise RelayAddressError(f"not a relay STATUS message: fields {sorted(f)}")
    limit = f.get(4, b"")
    lim = _pb_fields(limit) if isinstance(limit, bytes) else {}
    duration, data = lim.get(1, 0), lim.get(2, 0)
    return RelayLimit(
        int(f.get(5, 0)),
        duration if isinstance(duration, int) else 0,
        data if isinstance(data, int) else 0,
    )


async def probe_relay_limit(relay_peer_id: str, relay_maddrs: Sequence[str], timeout_s: float = 20.0) -> RelayLimit:
    """Ask the relay for a reservation from a throwaway libp2p peer (a node cannot open a
    stream to itself) and return what it answered. Raises on failure (TimeoutError, the
    daemon's errors, RelayAddressError)."""
    from hivemind.p2p import P2P, PeerID

    async def ask() -> RelayLimit:
        p2p = await P2P.create(initial_peers=list(relay_maddrs), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(relay_peer_id), HOP_PROTOCOL)
            try:
                writer.write(hop_reserve_request())
                await writer.drain()
                head = b""
                while not head or head[-1] & 0x80:  # the varint length prefix
                    head += await reader.readexactly(1)
                    if len(head) > 3:
                        raise RelayAddressError("relay message length prefix too long")
                n, _ = _read_varint(head, 0)
                if not 0 < n <= MAX_HOP_MESSAGE_BYTES:
                    raise RelayAddressError(f"relay message of {n} bytes")
                return parse_hop_status(await reader.readexactly(n))
            finally:
                writer.close()
        finally:
            await p2p.shutdown()

    return await asyncio.wait_for(ask(), timeout_s)


def relay_peer_ids(relays: Sequence[str]) -> list[str]:
    """The peer ids at the end of relay multiaddrs (`.../p2p/<id>`)."""
    out = []
    for r in relays:
        parts = r.strip("/").split("/")
        if len(parts) >= 2 and parts[-2] in ("p2p", "ipfs"):
            out.append(parts[-1])
    return out

"""How this worker can be reached by its peers: directly, through a relay, or not at all.

Decided before the DHT node starts, because libp2p's relay client is configured on the
daemon's command line (`bagel.protocol.relay`):

- `--relay`: a public volunteer that serves as a relay for NAT'd ones (and is itself direct);
- otherwise the source address this host uses towards the join string's peers (a UDP
  socket's `connect` picks it from the routing table and sends nothing): a publicly
  routable one means direct, and so does loopback (the swarm lives on this one host); a
  private one (RFC 1918, CGNAT, loopback) means this host sits
  behind a NAT, and the daemon reserves a slot at the join string's peers as relays (the
  coordinator's DHT node serves as one; so does any `--relay` volunteer listed in it).

After the start, `probe` checks what was planned: a relayed worker is reported RELAYED only
once its daemon holds a connection to one of its relays (where the reservation lives), and
UNREACHABLE with the reason otherwise. The coordinator gets the verdict in the profile.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bagel.protocol.messages import Reachability
from bagel.protocol.relay import (
    RelayPlan,
    circuit_addr,
    host_ip,
    is_circuit,
    is_loopback,
    is_publicly_routable,
    relay_peer_ids,
)

RELAY_WAIT_S = 15.0  # how long the start waits for a connection to a relay


@dataclass(frozen=True)
class Reach:
    """The verdict: how peers reach this worker, why, and the addresses it announces."""

    kind: Reachability
    detail: str
    maddrs: tuple[str, ...]
    relays: tuple[str, ...] = ()  # relay peer ids it is reachable through


def source_ip(peers: Sequence[str]) -> str | None:
    """The local address the routing table picks towards the first peer with an IP (no packet sent)."""
    for p in peers:
        ip = host_ip(p)
        if ip is None:
            continue
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return str(s.getsockname()[0])
    return None


def plan(serve_relay: bool, initial_peers: Sequence[str]) -> tuple[RelayPlan, str | None]:
    """The daemon's relay configuration for this host, and the source address it was decided on."""
    if serve_relay:
        return RelayPlan(serve=True), source_ip(initial_peers)
    src = source_ip(initial_peers)
    if src is not None and (is_publicly_routable(src) or is_loopback(src)):
        return RelayPlan(), src
    # a private source address, or none found: reserve at the join string's peers
    return RelayPlan(relays=tuple(p for p in initial_peers if "/p2p/" in p and not is_circuit(p))), src


async def probe(p2p: Any, relay_plan: RelayPlan, src: str | None, *, wait_s: float = RELAY_WAIT_S) -> Reach:
    """Check the plan against the running daemon and return the verdict."""
    me = p2p.peer_id.to_base58()
    visible = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
    direct = [m for m in visible if not is_circuit(m)]
    if not relay_plan.relays:
        kind = "relay for others" if relay_plan.serve else "public address"
        if src is not None and is_loopback(src):
            return Reach(Reachability.DIRECT, f"direct: loopback {src} (on the coordinator's host)", tuple(direct))
        if src is not None and is_publicly_routable(src):
            return Reach(Reachability.DIRECT, f"direct: {kind} {src}", tuple(direct))
        return Reach(
            Reachability.UNREACHABLE,
            f"not reachable: source address {src or 'unknown'} is private and no relay was given",
            tuple(direct),
        )
    wanted = dict(zip(relay_peer_ids(relay_plan.relays), relay_plan.relays, strict=False))
    deadline = time.monotonic() + wait_s
    connected: list[str] = []
    while True:
        try:
            peers = {p.peer_id.to_base58() for p in await p2p._client.list_peers()}
        except Exception:  # noqa: BLE001 - a daemon hiccup is retried until the deadline
            peers = set()
        connected = [pid for pid in wanted if pid in peers]
        if connected or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.25)
    if not connected:
        return Reach(
            Reachability.UNREACHABLE,
            f"not reachable: private address {src or 'unknown'} behind a NAT and no connection to a relay "
            f"({', '.join(relay_plan.relays)}) within {wait_s:g}s",
            tuple(direct),
        )
    circuits = tuple(circuit_addr(wanted[pid], me) for pid in connected)
    return Reach(
        Reachability.RELAYED,
        f"via relay {', '.join(pid[-8:] for pid in connected)}: private address {src or 'unknown'} behind a NAT "
        "(libp2p circuit relay v2; same-LAN peers dial the private address directly)",
        tuple(direct) + circuits,
        tuple(connected),
    )

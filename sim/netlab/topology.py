"""The plan of the network test bed: which namespaces, links and addresses, as plain data.

No I/O here: `plan(tag, homes, per_home, public)` returns the whole map, so its names and
addresses can be checked without root, and `bed.py` only executes it.

The map (documentation ranges of RFC 5737 on the public side, RFC 1918 behind the NATs):

    coord  198.51.100.10 ─┐                    ┌─ 203.0.113.11 home1 (NAT) 192.168.1.1 ─┬─ home1-1 192.168.1.11
    pub1   198.51.100.11 ─┼─ core 198.51.100.1 │                                          └─ home1-2 192.168.1.12
                          │       203.0.113.1 ─┴─ 203.0.113.12 home2 (NAT) 192.168.2.1 ─┬─ home2-1 192.168.2.11
                          ┘                                                               └─ home2-2 192.168.2.12

`core` is the "internet": two bridges (the public hosts' segment and the home routers'
uplinks) and routing between them, and no default route, so nothing leaves the bed. Every
node but `core` hangs off one link to its parent (`core` or its home router); a link is
named after its lower node, and its two directions are `up` (from the node) and `down`.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "bagelnl-"
MAX_HOMES = 8
MAX_PER_HOME = 8
MAX_PUBLIC = 8
IFNAMSIZ = 15  # the kernel's limit on an interface name, without the NUL

PUBLIC_NET = "198.51.100"  # TEST-NET-2: the coordinator and public workers
UPLINK_NET = "203.0.113"  # TEST-NET-3: the home routers' WAN side


@dataclass(frozen=True)
class Node:
    """One namespace. `addr` is its address on the link to `parent` (`core` has none)."""

    name: str
    kind: str  # "core" | "host" | "router"
    ns: str
    addr: str = ""  # a.b.c.d/len on its uplink
    gateway: str = ""  # its default route, inside the bed
    parent: str = ""  # the node at the other end of its link
    dev: str = ""  # its uplink device, in its own namespace
    parent_dev: str = ""  # the same link's device in the parent's namespace
    bridge: str = ""  # the parent's bridge the link is enslaved to
    lan: str = ""  # a router's LAN address (a.b.c.d/len on its bridge `lan`)

    @property
    def ip(self) -> str:
        return self.addr.partition("/")[0]


@dataclass(frozen=True)
class Topology:
    tag: str
    nodes: tuple[Node, ...]

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.tag}-"

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} on the bed (nodes: {', '.join(n.name for n in self.nodes)})")

    def links(self) -> tuple[Node, ...]:
        """The nodes that own a link (every node but `core`), in plan order."""
        return tuple(n for n in self.nodes if n.kind != "core")

    def homes(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.kind == "router")

    def hosts(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.kind == "host")


class TopologyError(ValueError):
    """A bed that cannot be planned (a bad tag or count)."""


def check_tag(tag: str) -> str:
    if not (1 <= len(tag) <= 8 and tag.isascii() and tag.isalnum() and tag == tag.lower()):
        raise TopologyError(f"netlab tag {tag!r}: 1 to 8 lower-case letters or digits")
    return tag


def plan(tag: str = "0", homes: int = 2, per_home: int = 2, public: int = 1) -> Topology:
    """The bed: `core`, `coord`, `public` public workers `pub<i>`, and `homes` NAT routers
    `home<h>` with `per_home` workers `home<h>-<j>` each."""
    check_tag(tag)
    for what, value, top in (("homes", homes, MAX_HOMES), ("per_home", per_home, MAX_PER_HOME)):
        if not 0 <= value <= top:
            raise TopologyError(f"netlab {what} = {value}: between 0 and {top}")
    if not 0 <= public <= MAX_PUBLIC:
        raise TopologyError(f"netlab public = {public}: between 0 and {MAX_PUBLIC}")
    prefix = f"{PREFIX}{tag}-"
    nodes = [Node(name="core", kind="core", ns=prefix + "core")]

    def host(name: str, addr: str, gateway: str, parent: str, bridge: str) -> Node:
        return Node(
            name=name,
            kind="host",
            ns=prefix + name,
            addr=addr,
            gateway=gateway,
            parent=parent,
            dev="eth0",
            parent_dev=f"v-{name}",
            bridge=bridge,
        )

    nodes.append(host("coord", f"{PUBLIC_NET}.10/24", f"{PUBLIC_NET}.1", "core", "br-pub"))
    for i in range(1, public + 1):
        nodes.append(host(f"pub{i}", f"{PUBLIC_NET}.{10 + i}/24", f"{PUBLIC_NET}.1", "core", "br-pub"))
    for h in range(1, homes + 1):
        router = f"home{h}"
        nodes.append(
            Node(
                name=router,
                kind="router",
                ns=prefix + router,
                addr=f"{UPLINK_NET}.{10 + h}/24",
                gateway=f"{UPLINK_NET}.1",
                parent="core",
                dev="wan",
                parent_dev=f"v-{router}",
                bridge="br-isp",
                lan=f"192.168.{h}.1/24",
            )
        )
        for j in range(1, per_home + 1):
            nodes.append(host(f"{router}-{j}", f"192.168.{h}.{10 + j}/24", f"192.168.{h}.1", router, "lan"))
    for n in nodes:
        for dev in (n.dev, n.parent_dev):
            assert len(dev) <= IFNAMSIZ, dev
    return Topology(tag=tag, nodes=tuple(nodes))


def describe(topo: Topology) -> list[str]:
    """The map as lines: one per node, with its namespace and addresses."""
    out = []
    for n in topo.nodes:
        if n.kind == "core":
            out.append(
                f"{n.name:10s} {n.ns:24s} {PUBLIC_NET}.1/24 (br-pub), {UPLINK_NET}.1/24 (br-isp); no default route"
            )
        elif n.kind == "router":
            out.append(f"{n.name:10s} {n.ns:24s} wan {n.addr} via {n.gateway}, lan {n.lan}; NAT (masquerade)")
        else:
            out.append(f"{n.name:10s} {n.ns:24s} {n.addr} via {n.gateway} (link to {n.parent})")
    return out

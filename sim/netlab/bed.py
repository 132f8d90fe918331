"""`NetLab`: the network test bed built from Linux network namespaces, veth pairs, bridges,
nftables NAT and tc shaping, on this one machine (root only).

What it builds is `topology.plan`'s map: a public segment on documentation ranges, home
routers that masquerade their LAN behind one public address and accept no inbound
connection, and a shaped link under every node. Nothing is connected to the host's own
namespace: every veth is created with both ends already inside the bed's namespaces, and no
namespace has a route out of the bed.

Links are shaped at run time, per direction, on the sending device's egress:
- bandwidth with `tbf` (a token bucket: Linux's sch_tbf),
- latency with `netem` as tbf's child, where the kernel has sch_netem (`NetLab.has_netem`);
  a kernel without it refuses a delay with a `NetLabError` that says so, never silently,
- loss with netem where present, else with an nftables `numgen random` drop rule on the
  receiving device's ingress (the same Bernoulli loss per packet),
- a partition drops every IP packet of a link in both directions (nftables ingress on both
  ends; ARP still passes), and healing removes the rule; addresses, routes and the NAT's
  state stay.

Every name starts with `bagelnl-<tag>-`, so `setup` first removes whatever a killed run of
the same tag left, and `teardown` (idempotent, also on the context manager's exit) kills
every process started in the bed and deletes the namespaces, which takes their veths,
bridges, qdiscs and nftables tables with them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from bagel.sim.netlab.topology import PREFIX, Node, Topology, plan

CMD_TIMEOUT_S = 20.0
NFT_TABLE = "bagelnl"
# Faults drop IP packets only: ARP keeps working, so a healed link carries traffic at once
# instead of waiting out a neighbour entry that went FAILED while every frame was dropped.
IP_ONLY = "meta protocol { ip, ip6 }"


class NetLabError(RuntimeError):
    """The bed could not be built or changed; the message names the command and its error."""


@dataclass(frozen=True)
class Shape:
    """One direction of a link: rate in Mbit/s (None: unlimited), one-way delay in ms, loss in %."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not 0.01 <= self.rate_mbit <= 100_000:
            raise ValueError(f"rate {self.rate_mbit} Mbit/s: between 0.01 and 100000")
        if not 0 <= self.delay_ms <= 10_000:
            raise ValueError(f"delay {self.delay_ms} ms: between 0 and 10000")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(f"loss {self.loss_pct} %: between 0 and 100")

    @property
    def empty(self) -> bool:
        return self.rate_mbit is None and self.delay_ms == 0 and self.loss_pct == 0


@dataclass(frozen=True)
class LinkState:
    """A link as the kernel holds it (`NetLab.link_state`): partitioned or not, and the rate
    and loss of each direction (delay is not read back)."""

    link: str
    partitioned: bool
    up: Shape
    down: Shape

    def as_dict(self) -> dict[str, Any]:
        return {
            "partitioned": self.partitioned,
            "up": {"rate_mbit": self.up.rate_mbit, "loss_pct": self.up.loss_pct},
            "down": {"rate_mbit": self.down.rate_mbit, "loss_pct": self.down.loss_pct},
        }


def missing_prerequisite() -> str | None:
    """Why this machine cannot hold the bed, or None: not root, no `ip`/`tc`/`nft`, or a
    kernel (or container) that refuses a network namespace."""
    if os.geteuid() != 0:
        return "netlab needs root (network namespaces, nftables and tc)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"netlab needs `{tool}` (apt-get install {package}, or `make netlab` to install it)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"netlab cannot run `ip netns add`: {e}"
    if made.returncode != 0:
        return f"this machine refuses network namespaces: {made.stderr.strip()}"
    try:
        nft = subprocess.run(
            ["ip", "netns", "exec", probe, "nft", "list", "ruleset"],
            capture_output=True,
            text=True,
            timeout=CMD_TIMEOUT_S,
        )
        if nft.returncode != 0:
            return f"nftables does not work in a namespace here: {nft.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=CMD_TIMEOUT_S)
    return None


def _sh(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetLabError(f"`{' '.join(argv)}`: {e}") from e
    if check and done.returncode != 0:
        raise NetLabError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def bed_namespaces(prefix: str = PREFIX) -> list[str]:
    """The namespaces on this machine whose name starts with `prefix` (leftovers included)."""
    done = _sh(["ip", "-j", "netns", "list"], check=False)
    if done.returncode != 0 or not done.stdout.strip():
        return []
    return sorted(e["name"] for e in json.loads(done.stdout) if str(e.get("name", "")).startswith(prefix))


def kill_namespace(ns: str) -> None:
    """SIGKILL every process inside `ns`, then delete it (its devices and tables go with it)."""
    pids = _sh(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _sh(["ip", "netns", "del", ns], check=False)


def remove_bed(prefix: str = PREFIX) -> list[str]:
    """Remove every namespace named with `prefix` (a whole bed, or a killed run's leftovers)."""
    gone = bed_namespaces(prefix)
    for ns in gone:
        kill_namespace(ns)
    return gone


def _tbf_burst_bytes(rate_mbit: float) -> int:
    """10 ms worth of tokens, and never under two full frames, so tbf never starves a packet."""
    return max(2 * 1514, int(rate_mbit * 1e6 / 8 * 0.010))


class NetLab:
    """The bed as a context manager: `with NetLab(tag="t1") as lab: lab.run_in("home1-1", argv)`."""

    def __init__(self, tag: str = "0", homes: int = 2, per_home: int = 2, public: int = 1) -> None:
        self.topology: Topology = plan(tag, homes, per_home, public)
        self.procs: list[subprocess.Popen[Any]] = []
        self.has_netem = False

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def attach(cls, tag: str = "0") -> NetLab:
        """The bed of `tag` that is already up (built by another process, e.g. `netlab up`)."""
        topo = plan(tag, 0, 0, 0)
        names = {ns.removeprefix(topo.prefix) for ns in bed_namespaces(topo.prefix)}
        if "core" not in names:
            raise NetLabError(f"no test bed with tag {tag!r} is up (start one with `make netlab`)")
        homes = sum(1 for n in names if re.fullmatch(r"home\d+", n))
        per_home = sum(1 for n in names if re.fullmatch(r"home1-\d+", n))
        public = sum(1 for n in names if re.fullmatch(r"pub\d+", n))
        lab = cls(tag, homes, per_home, public)
        lab.has_netem = lab._probe_netem(lab.topology.node("core").ns)
        return lab

    def __enter__(self) -> NetLab:
        self.setup()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.teardown()

    def setup(self) -> None:
        """Remove this tag's leftovers, then build the whole map; on any failure remove what was built."""
        reason = missing_prerequisite()
        if reason:
            raise NetLabError(reason)
        remove_bed(self.topology.prefix)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise

    def teardown(self) -> None:
        """Stop every process started here, then delete every namespace of this tag. Safe to repeat."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=3.0)
        self.procs.clear()
        remove_bed(self.topology.prefix)

    def _ns(self, ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _sh(["ip", "netns", "exec", ns, *argv], check=check)

    def _build(self) -> None:
        topo = self.topology
        for n in topo.nodes:
            _sh(["ip", "netns", "add", n.ns])
            _sh(["ip", "-n", n.ns, "link", "set", "lo", "up"])
        core = topo.node("core")
        for bridge, addr in (("br-pub", "198.51.100.1/24"), ("br-isp", "203.0.113.1/24")):
            self._bridge(core.ns, bridge, addr)
        self._sysctl(core.ns, "net.ipv4.ip_forward", "1")
        for r in topo.homes():
            self._bridge(r.ns, "lan", r.lan)
            self._sysctl(r.ns, "net.ipv4.ip_forward", "1")
        for n in topo.links():
            parent = topo.node(n.parent)
            _sh(
                [
                    "ip",
                    "-n",
                    parent.ns,
                    "link",
                    "add",
                    n.parent_dev,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    n.dev,
                    "netns",
                    n.ns,
                ]
            )
            _sh(["ip", "-n", parent.ns, "link", "set", n.parent_dev, "master", n.bridge])
            _sh(["ip", "-n", parent.ns, "link", "set", n.parent_dev, "up"])
            _sh(["ip", "-n", n.ns, "addr", "add", n.addr, "dev", n.dev])
            _sh(["ip", "-n", n.ns, "link", "set", n.dev, "up"])
            _sh(["ip", "-n", n.ns, "route", "add", "default", "via", n.gateway])
        for r in topo.homes():
            self._nat(r)
        self.has_netem = self._probe_netem(core.ns)

    def _bridge(self, ns: str, name: str, addr: str) -> None:
        _sh(["ip", "-n", ns, "link", "add", name, "type", "bridge"])
        _sh(["ip", "-n", ns, "addr", "add", addr, "dev", name])
        _sh(["ip", "-n", ns, "link", "set", name, "up"])

    def _sysctl(self, ns: str, key: str, value: str) -> None:
        self._ns(ns, "sysctl", "-q", "-w", f"{key}={value}")

    def _nat(self, router: Node) -> None:
        """A home router: masquerade the LAN behind the WAN address; forward only LAN-started
        flows and their replies; accept nothing new on the WAN (no port forwards)."""
        rules = f"""
table inet {NFT_TABLE}_nat {{
  chain postrouting {{ type nat hook postrouting priority srcnat; policy accept;
    oifname "wan" masquerade
  }}
  chain forward {{ type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
    iifname "lan" oifname "lan" accept
  }}
  chain input {{ type filter hook input priority filter; policy drop;
    iifname "lo" accept
    ct state established,related accept
    iifname "lan" accept
  }}
}}
"""
        _sh(["ip", "netns", "exec", router.ns, "nft", "-f", "-"], stdin=rules)

    def _probe_netem(self, ns: str) -> bool:
        dev = "br-pub"
        made = self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms", check=False)
        if made.returncode != 0:
            return False
        self._ns(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        return True

    # ------------------------------------------------------------------ processes

    def exec_argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `node`'s namespace: `ip netns exec NS ...`, which enters the
        namespace and execs `argv` in place (the pid a caller starts is the program's)."""
        return ["ip", "netns", "exec", self.topology.node(node).ns, *argv]

    def run_in(self, node: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `node`'s namespace (`ip netns exec`), in its own process group;
        `teardown` stops it. Keyword arguments go to `subprocess.Popen`."""
        popen.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(self.exec_argv(node, argv), **popen)
        self.procs.append(proc)
        return proc

    def ip(self, node: str) -> str:
        """The node's address: a host's own, a router's public WAN address."""
        return self.topology.node(node).ip

    # ------------------------------------------------------------------ link faults

    def _ends(self, link: str) -> tuple[tuple[str, str], tuple[str, str]]:
        """((ns, dev) sending up, (ns, dev) sending down) of a link."""
        n = self.topology.node(link)
        if n.kind == "core":
            raise NetLabError("`core` owns no link; links are named after their lower node")
        return (n.ns, n.dev), (self.topology.node(n.parent).ns, n.parent_dev)

    def shape(
        self,
        link: str,
        rate_mbit: float | None = None,
        delay_ms: float = 0.0,
        loss_pct: float = 0.0,
        direction: str = "both",
    ) -> None:
        """Set one or both directions of `link` (replacing what was there; all defaults: unshaped)."""
        self.shape_link(link, **{direction: Shape(rate_mbit, delay_ms, loss_pct)})

    def shape_link(
        self, link: str, up: Shape | None = None, down: Shape | None = None, both: Shape | None = None
    ) -> None:
        """Set the `up` and `down` directions of a link separately (None leaves a direction as it is)."""
        if both is not None:
            up = down = both
        (up_ns, up_dev), (down_ns, down_dev) = self._ends(link)
        for shape, (ns, dev), (peer_ns, peer_dev) in (
            (up, (up_ns, up_dev), (down_ns, down_dev)),
            (down, (down_ns, down_dev), (up_ns, up_dev)),
        ):
            if shape is None:
                continue
            if shape.delay_ms and not self.has_netem:
                raise NetLabError(
                    "this kernel has no sch_netem (CONFIG_NET_SCH_NETEM), so the bed cannot add latency; "
                    "bandwidth (tbf), loss and partitions still work"
                )
            self._egress(ns, dev, shape)
            # Without netem, loss is dropped where the packet arrives (the peer's ingress);
            # numgen draws uniformly in [0, 1e6): Bernoulli loss at ppm resolution.
            loss = 0.0 if self.has_netem else shape.loss_pct
            ppm = round(loss * 10_000)
            draw = "" if ppm >= 1_000_000 else f"numgen random mod 1000000 < {ppm} "
            drop = [f"{IP_ONLY} {draw}drop"] if ppm else []
            self._set_ingress(peer_ns, peer_dev, "loss", drop)

    def _egress(self, ns: str, dev: str, shape: Shape) -> None:
        self._ns(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        netem = []
        if self.has_netem and (shape.delay_ms or shape.loss_pct):
            netem = ["netem", "limit", "100000"]
            if shape.delay_ms:
                netem += ["delay", f"{shape.delay_ms}ms"]
            if shape.loss_pct:
                netem += ["loss", f"{shape.loss_pct}%"]
        if shape.rate_mbit is not None:
            kbit = max(1, round(shape.rate_mbit * 1000))
            # latency bounds tbf's queue: the largest delay a packet may wait for tokens
            self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                     "rate", f"{kbit}kbit", "burst", str(_tbf_burst_bytes(shape.rate_mbit)),
                     "latency", "200ms")  # fmt: skip
            if netem:
                self._ns(ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *netem)
        elif netem:
            self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "10:", *netem)

    def _set_ingress(self, ns: str, dev: str, kind: str, rules: Sequence[str]) -> None:
        """Rewrite one fault's ingress chain on one device (`part`: a partition, `loss`: drops
        where netem is missing). Each fault owns its chain, so the ruleset itself is the
        state and a later process (the CLI) can change one fault without knowing the others."""
        chain = f"{kind}_{dev.replace('-', '_')}"
        priority = {"part": -500, "loss": -400}[kind]
        script = [
            f"add table netdev {NFT_TABLE}",
            f'add chain netdev {NFT_TABLE} {chain} {{ type filter hook ingress device "{dev}" priority {priority}; }}',
            f"flush chain netdev {NFT_TABLE} {chain}",
            *(f"add rule netdev {NFT_TABLE} {chain} {r}" for r in rules),
        ]
        _sh(["ip", "netns", "exec", ns, "nft", "-f", "-"], stdin="\n".join(script) + "\n")

    def partition(self, link: str) -> None:
        """Cut `link` (a home's name cuts that home off the internet): every packet dropped, both ways."""
        for ns, dev in self._ends(link):
            self._set_ingress(ns, dev, "part", [f"{IP_ONLY} drop"])

    def heal(self, link: str) -> None:
        """Undo `partition(link)`; shaping and loss stay as they were."""
        for ns, dev in self._ends(link):
            self._set_ingress(ns, dev, "part", [])

    # ------------------------------------------------------------------ inspection

    def link_state(self, link: str) -> LinkState:
        """What the kernel holds for `link` now, read back from tc and nftables (not from what
        was asked): whether it is partitioned, and each direction's rate and loss."""
        (u_ns, u_dev), (d_ns, d_dev) = self._ends(link)
        parts = [self._chain_rules(ns, f"part_{dev.replace('-', '_')}") for ns, dev in ((u_ns, u_dev), (d_ns, d_dev))]
        # a direction's loss is dropped where it arrives: up at the parent's end, down at the node's
        up_loss = self._nft_loss(self._chain_rules(d_ns, f"loss_{d_dev.replace('-', '_')}"))
        down_loss = self._nft_loss(self._chain_rules(u_ns, f"loss_{u_dev.replace('-', '_')}"))
        up_rate, up_netem = self._tc_shape(u_ns, u_dev)
        down_rate, down_netem = self._tc_shape(d_ns, d_dev)
        return LinkState(
            link=link,
            partitioned=all(any(r.endswith("drop") for r in rules) for rules in parts),
            up=Shape(up_rate, 0.0, min(100.0, up_loss + up_netem)),
            down=Shape(down_rate, 0.0, min(100.0, down_loss + down_netem)),
        )

    def _chain_rules(self, ns: str, chain: str) -> list[str]:
        """The rule lines of one of the bed's netdev chains (none when it was never made)."""
        done = self._ns(ns, "nft", "list", "chain", "netdev", NFT_TABLE, chain, check=False)
        if done.returncode != 0:
            return []
        lines = [ln.strip() for ln in done.stdout.splitlines()]
        return [ln for ln in lines if ln and not ln.startswith(("table", "chain", "type", "}"))]

    @staticmethod
    def _nft_loss(rules: Sequence[str]) -> float:
        """The loss in % that `_set_ingress`'s rules drop: numgen ppm, or every packet."""
        for r in rules:
            m = re.search(r"numgen random mod 1000000 < (\d+) drop$", r)
            if m:
                return int(m.group(1)) / 10_000
            if r.endswith("drop"):
                return 100.0
        return 0.0

    def _tc_shape(self, ns: str, dev: str) -> tuple[float | None, float]:
        """(tbf rate in Mbit/s or None, netem loss in %) of a device's egress, from `tc -j`."""
        done = self._ns(ns, "tc", "-j", "qdisc", "show", "dev", dev, check=False)
        try:
            qdiscs = json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else []
        except json.JSONDecodeError:
            return None, 0.0
        rate: float | None = None
        loss = 0.0
        for q in qdiscs:
            opts = q.get("options") or {}
            if q.get("kind") == "tbf" and isinstance(opts.get("rate"), (int, float)):
                rate = round(float(opts["rate"]) * 8 / 1e6, 6)  # tc reports bytes/s
            elif q.get("kind") == "netem":
                lr = opts.get("loss_random") or {}
                if isinstance(lr.get("loss"), (int, float)):
                    loss = float(lr["loss"]) * 100.0
        return rate, loss

    def qdiscs(self, link: str) -> dict[str, str]:
        """`tc qdisc show` of both ends of a link, by direction (for the map and for tests)."""
        (u_ns, u_dev), (d_ns, d_dev) = self._ends(link)
        return {
            "up": self._ns(u_ns, "tc", "qdisc", "show", "dev", u_dev).stdout.strip(),
            "down": self._ns(d_ns, "tc", "qdisc", "show", "dev", d_dev).stdout.strip(),
        }

"""`python -m bagel.sim.netlab up | down | status | shape | partition | heal` (`make netlab`).

`up` builds the bed (removing a leftover of the same tag first), shapes every home's uplink
like a home connection (20 Mbit/s up, 100 Mbit/s down, 20 ms each way where the kernel has
netem) and prints the map; the bed stays until `down`. Run a process inside it with
`ip netns exec bagelnl-0-home1-1 CMD...`. Exit codes: 0 ok, 1 the machine refused, 2 usage.
"""

from __future__ import annotations

import argparse
import sys

from bagel.sim.netlab.bed import NetLab, NetLabError, Shape, bed_namespaces, missing_prerequisite, remove_bed
from bagel.sim.netlab.topology import TopologyError, describe, plan

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

HOME_UP = Shape(rate_mbit=20.0)
HOME_DOWN = Shape(rate_mbit=100.0)
HOME_DELAY_MS = 20.0  # each way: 40 ms round trip on the access link


def _up(a: argparse.Namespace) -> int:
    lab = NetLab(a.tag, a.homes, a.per_home, a.public)
    lab.setup()
    delay = HOME_DELAY_MS if lab.has_netem else 0.0
    if not a.no_shape:
        for home in lab.topology.homes():
            lab.shape_link(
                home.name,
                up=Shape(HOME_UP.rate_mbit, delay),
                down=Shape(HOME_DOWN.rate_mbit, delay),
            )
    print(f"netlab {a.tag}: up, {len(lab.topology.nodes)} namespaces")
    for line in describe(lab.topology):
        print("  " + line)
    if a.no_shape:
        print("links: unshaped")
    else:
        lat = f"{delay:g} ms each way" if delay else "no added latency (this kernel has no sch_netem)"
        print(f"home uplinks: {HOME_UP.rate_mbit:g} Mbit/s up, {HOME_DOWN.rate_mbit:g} Mbit/s down, {lat}")
    print(f"run inside: ip netns exec {lab.topology.node('home1-1').ns if lab.topology.homes() else '<ns>'} CMD")
    print(f"remove:     python -m bagel.sim.netlab down --tag {a.tag}   (or make netlab-down)")
    return EXIT_OK


def _down(a: argparse.Namespace) -> int:
    prefix = plan(a.tag, 0, 0, 0).prefix
    gone = remove_bed(prefix)
    print(f"netlab {a.tag}: removed {len(gone)} namespaces" if gone else f"netlab {a.tag}: nothing to remove")
    return EXIT_OK


def _status(a: argparse.Namespace) -> int:
    lab = NetLab.attach(a.tag)
    print(f"netlab {a.tag}: up, {len(bed_namespaces(lab.topology.prefix))} namespaces, netem {lab.has_netem}")
    for line in describe(lab.topology):
        print("  " + line)
    for link in lab.topology.links():
        q = lab.qdiscs(link.name)
        print(f"  link {link.name:8s} up: {q['up'] or '-'} | down: {q['down'] or '-'}")
    return EXIT_OK


def _shape(a: argparse.Namespace) -> int:
    NetLab.attach(a.tag).shape(a.link, a.rate, a.delay, a.loss, a.direction)
    print(
        f"netlab {a.tag}: {a.link} {a.direction}: rate {a.rate or 'unlimited'} Mbit/s, "
        f"{a.delay:g} ms, {a.loss:g} % loss"
    )
    return EXIT_OK


def _fault(a: argparse.Namespace) -> int:
    lab = NetLab.attach(a.tag)
    (lab.partition if a.cmd == "partition" else lab.heal)(a.link)
    print(f"netlab {a.tag}: {a.link} {'partitioned' if a.cmd == 'partition' else 'healed'}")
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bagel.sim.netlab", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build the bed and print its map")
    up.add_argument("--homes", type=int, default=2)
    up.add_argument("--per-home", type=int, default=2)
    up.add_argument("--public", type=int, default=1, help="public workers besides the coordinator")
    up.add_argument("--no-shape", action="store_true", help="leave every link unshaped")
    up.set_defaults(func=_up)
    sub.add_parser("down", help="remove the bed (and any leftover of its tag)").set_defaults(func=_down)
    sub.add_parser("status", help="the map and every link's qdiscs").set_defaults(func=_status)
    sh = sub.add_parser("shape", help="set a link's rate, delay and loss (unset: unshaped)")
    sh.add_argument("link")
    sh.add_argument("--rate", type=float, default=None, help="Mbit/s")
    sh.add_argument("--delay", type=float, default=0.0, help="ms, one way")
    sh.add_argument("--loss", type=float, default=0.0, help="percent")
    sh.add_argument("--direction", choices=("up", "down", "both"), default="both")
    sh.set_defaults(func=_shape)
    for name in ("partition", "heal"):
        f = sub.add_parser(name, help=f"{name} a link (a home's name: its uplink)")
        f.add_argument("link")
        f.set_defaults(func=_fault)
    for s in sub.choices.values():
        s.add_argument("--tag", default="0", help="names the bed (bagelnl-TAG-*); default 0")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.cmd != "down":
        reason = missing_prerequisite()
        if reason:
            print(f"netlab: {reason}", file=sys.stderr)
            return EXIT_FAILED
    try:
        return int(a.func(a))
    except (TopologyError, ValueError, KeyError) as e:
        print(f"netlab: {e.args[0] if e.args else e}", file=sys.stderr)
        return EXIT_USAGE
    except NetLabError as e:
        print(f"netlab: {e}", file=sys.stderr)
        return EXIT_FAILED

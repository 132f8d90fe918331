"""Benchmark: does a real run work across the network test bed's NATs, as the code is today?

For each placement of two workers, on a fresh bed (sim/netlab/, root only): a real
`bagel-coordinator serve` on the public segment (gRPC on 198.51.100.10:7070, TLS, its DHT on
198.51.100.10:7071), then real `bagel-worker join` processes with the printed join string,
in the namespaces named; after `--seconds`, the coordinator's store is read (rounds
committed and aborted, the last abort's reason, the peer addresses each worker announced)
and the workers' `--log-json` commits are compared (bit-identical replicas: the same state
hash for every round both committed; `shared`: the commits with two or more contributors,
fewer on either worker, since a worker left alone in its cell commits rounds by itself).
Also logged: each worker's reachability verdict, the groups that averaged per cell and how each
worker was connected to each peer (direct or through the relay). Prints a table; `--json FILE`
writes the figures. Never asserted in tests; a finding, not a claim.

    sudo .venv/bin/python bench/netlab_nat.py [--seconds 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bagel.sim.netlab.bed import NetLab, missing_prerequisite
from bagel.sim.netlab.logs import events, wait_line
from bagel.sim.netlab.runs import tiny_run_spec

SPEC = tiny_run_spec("netlab", max_replicas=4)

PLACEMENTS = {
    "same home": ("home1-1", "home1-2"),
    "public + home": ("pub1", "home1-1"),
    "two homes": ("home1-1", "home2-1"),
    # 2 workers behind each NAT and 1 public, over 2 cells
    "2x2 homes + public": ("home1-1", "home1-2", "home2-1", "home2-2", "pub1"),
}
CELLS = {"2x2 homes + public": 2}


def run_placement(name: str, nodes: tuple[str, ...], seconds: float, root: Path) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "spec.toml"
    spec.write_text(SPEC.replace("timestep_ranges = 1", f"timestep_ranges = {CELLS.get(name, 1)}"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    py = sys.executable
    with NetLab(tag="bn", homes=2, per_home=2, public=1) as lab:

        def start(node: str, argv: list[str], log: Path) -> None:
            with open(log, "ab") as f:
                lab.run_in(node, argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

        coord_log = root / "coord.log"
        start(
            "coord",
            [py, "-m", "bagel.coordinator", "serve", "--run", str(spec), "--data-dir", str(root / "coord"),
             "--listen", "198.51.100.10:7070", "--dht-listen", "/ip4/198.51.100.10/tcp/7071", "--tick-ms", "100"],
            coord_log,
        )  # fmt: skip
        join = wait_line(coord_log, "join:", 120)
        for node in nodes:
            start(
                node,
                [py, "-m", "bagel.worker", "join", join, "--data-dir", str(root / node), "--log-json",
                 "--name", node, "--reduce-timeout-s", "20"],
                root / f"{node}.log",
            )  # fmt: skip
        time.sleep(seconds)
    status = subprocess.run(
        [py, "-m", "bagel.coordinator", "status", "--data-dir", str(root / "coord"), "--json", "--rounds", "50"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    st = json.loads(status.stdout) if status.returncode == 0 else {}
    rounds = st.get("rounds", [])
    aborted = [r for r in rounds if r.get("state") == "aborted"]
    announced = {m["worker_id"]: m["peer"]["maddrs"] for r in rounds[:1] for m in r.get("members", []) if "peer" in m}
    committed = {n: events(root / f"{n}.log", "committed") for n in nodes}
    commits = {n: {(e["cell"], e["round"]): e["hash"] for e in committed[n]} for n in nodes}
    # bit-identical replicas: every (cell, round) committed by two or more workers has one hash
    keys = {k for c in commits.values() for k in c}
    holders = {k: {commits[n][k] for n in nodes if k in commits[n]} for k in keys}
    common = {k for k in keys if sum(k in commits[n] for n in nodes) >= 2}
    identical = all(len(holders[k]) == 1 for k in common)
    registered = {n: bool(events(root / f"{n}.log", "registered")) for n in nodes}
    # a commit with one contributor is a worker training alone, not an exchange across the path
    shared = {n: sum(1 for e in committed[n] if int(e.get("contributors", 0)) >= 2) for n in nodes}
    reach = {n: (events(root / f"{n}.log", "reachability") or [{}])[-1] for n in nodes}
    ids = {(events(root / f"{n}.log", "identity") or [{}])[0].get("worker_id", ""): n for n in nodes}
    # the cells' groups: which nodes averaged together, and how each reached the others
    groups: dict[str, set[tuple[str, ...]]] = {}
    paths: dict[str, dict[str, str]] = {}
    for n in nodes:
        for e in committed[n]:
            if int(e.get("contributors", 0)) >= 2:
                peers = tuple(sorted([n, *(ids.get(w, w[:8]) for w in e.get("paths", {}))]))
                groups.setdefault(e["cell"], set()).add(peers)
                for w, how in e.get("paths", {}).items():
                    paths.setdefault(n, {})[ids.get(w, w[:8])] = how
    cells = st.get("cells", [{}])
    return {
        "placement": name,
        "workers": list(nodes),
        "seconds": seconds,
        "registered": registered,
        "committed_rounds": sum(int(c.get("committed_round", 0)) for c in cells),
        "aborted_attempts_in_last_50": len(aborted),
        "last_abort_reason": aborted[0].get("reason", "") if aborted else "",
        "cells_committed_rounds": {c.get("cell_id", ""): c.get("committed_round", 0) for c in cells},
        "rounds_committed_by_2_or_more": len(common),
        "commits_with_2_or_more_contributors": shared,
        "replicas_bit_identical": identical if common else None,
        "announced_maddrs": announced,
        "reachability": {n: [r.get("reachability", "?"), r.get("message", "")] for n, r in reach.items()},
        "groups": {c: sorted(list(g) for g in gs) for c, gs in groups.items()},
        "paths": paths,
        "exchange_failed_events": {n: len(events(root / f"{n}.log", "exchange-failed")) for n in nodes},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--only", choices=sorted(PLACEMENTS), action="append")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="keep logs and data dirs here (default: a temporary folder)")
    a = ap.parse_args()
    reason = missing_prerequisite()
    if reason:
        print(f"netlab_nat: {reason}", file=sys.stderr)
        return 1
    results = []
    with tempfile.TemporaryDirectory(prefix="netlab-nat-") as tmp:
        base = a.keep or Path(tmp)
        for name in a.only or list(PLACEMENTS):
            results.append(run_placement(name, PLACEMENTS[name], a.seconds, base / name.replace(" ", "-")))
    print(
        f"{'placement':19s} {'workers':40s} {'s':>4s} {'commits':>7s} {'shared':>6s} {'aborts':>6s} "
        f"{'identical':>9s}  last abort"
    )
    for r in results:
        print(
            f"{r['placement']:19s} {','.join(r['workers']):40s} {r['seconds']:4.0f} {r['committed_rounds']:7d} "
            f"{min(r['commits_with_2_or_more_contributors'].values()):6d} "
            f"{r['aborted_attempts_in_last_50']:6d} {str(r['replicas_bit_identical']):>9s}  {r['last_abort_reason']}"
        )
    for r in results:
        for n, (kind, why) in r["reachability"].items():
            print(f"  {r['placement']}: {n:8s} {kind:9s} {why[:90]}")
        for c, gs in r["groups"].items():
            print(f"  {r['placement']}: {c} averaged in groups {gs}")
        for n, ps in r["paths"].items():
            print(f"  {r['placement']}: {n} reached {ps}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: a public volunteer started with `--relay` carries the exchange of two workers
behind two different NATs, with no help from the coordinator's relay.

On a fresh bed (sim/netlab/, root only): the coordinator on the public segment; `pub1` joins
with the printed join string and `--relay` on a fixed DHT port; the two home workers get a
join string that lists only pub1's DHT address (the operator's way to hand out a volunteer
relay: the join string's peers are the relays a NAT'd worker reserves at). After
`--seconds`, each worker's reachability verdict, its commits with two or more contributors,
the connection kind it logged to each peer and the hashes of the rounds all committed.
Prints a table; `--json FILE` writes the figures. A finding, not a test.

    sudo .venv/bin/python bench/netlab_relay_volunteer.py [--seconds 100] [--json out.json]
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

from bagel.protocol.joinstring import make_join_string, parse_join_string
from bagel.sim.netlab.bed import NetLab, missing_prerequisite
from bagel.sim.netlab.logs import events, wait_line
from bagel.sim.netlab.runs import tiny_run_spec

SPEC = tiny_run_spec("netlab", max_replicas=4)


NODES = ("pub1", "home1-1", "home2-1")


def run(seconds: float, root: Path) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "spec.toml"
    spec.write_text(SPEC)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    py = sys.executable
    with NetLab(tag="nv", homes=2, per_home=1, public=1) as lab:

        def start(node: str, argv: list[str]) -> None:
            with open(root / f"{node}.log", "ab") as f:
                lab.run_in(node, argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

        start(
            "coord",
            [py, "-m", "bagel.coordinator", "serve", "--run", str(spec), "--data-dir", str(root / "coord"),
             "--listen", "198.51.100.10:7070", "--dht-listen", "/ip4/198.51.100.10/tcp/7071", "--tick-ms", "100"],
        )  # fmt: skip
        join = wait_line(root / "coord.log", "join:", 120)
        start(
            "pub1",
            [py, "-m", "bagel.worker", "join", join, "--data-dir", str(root / "pub1"), "--log-json", "--name", "pub1",
             "--relay", "--dht-listen", "/ip4/198.51.100.11/tcp/7072"],
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not events(root / "pub1.log", "reachability"):
            time.sleep(0.5)
        reach = events(root / "pub1.log", "reachability")
        if not reach:
            raise RuntimeError(f"pub1 did not start:\n{(root / 'pub1.log').read_text()[-2000:]}")
        relay = next(m for m in reach[-1]["maddrs"] if m.startswith("/ip4/198.51.100.11/tcp/7072/"))
        info = parse_join_string(join)
        volunteer_join = make_join_string(info.run_id, info.coordinator_public_key, [relay], info.tls_fingerprint)
        for n in NODES[1:]:
            start(
                n,
                [py, "-m", "bagel.worker", "join", volunteer_join, "--data-dir", str(root / n), "--log-json",
                 "--name", n, "--reduce-timeout-s", "20"],
            )  # fmt: skip
        time.sleep(seconds)
    ids = {(events(root / f"{n}.log", "identity") or [{}])[0].get("worker_id", ""): n for n in NODES}
    out: dict[str, Any] = {"relay": relay, "seconds": seconds, "workers": {}}
    hashes: dict[str, dict[tuple[str, int], str]] = {}
    for n in NODES:
        r = (events(root / f"{n}.log", "reachability") or [{}])[-1]
        ev = [e for e in events(root / f"{n}.log", "committed") if int(e.get("contributors", 0)) >= 2]
        hashes[n] = {(e["cell"], e["round"]): e["hash"] for e in ev}
        paths: dict[str, set[str]] = {}
        for e in ev:
            for w, how in e.get("paths", {}).items():
                paths.setdefault(ids.get(w, w[:8]), set()).add(how)
        out["workers"][n] = {
            "reachability": r.get("reachability", "?"),
            "detail": r.get("message", ""),
            "shared_commits": len(ev),
            "paths": {p: sorted(h) for p, h in paths.items()},
        }
    common = set.intersection(*(set(h) for h in hashes.values()))
    out["rounds_all_committed"] = len(common)
    out["bit_identical"] = all(len({hashes[n][k] for n in NODES}) == 1 for k in common)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=100.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="keep logs and data dirs here (default: a temporary folder)")
    a = ap.parse_args()
    reason = missing_prerequisite()
    if reason:
        print(f"netlab_relay_volunteer: {reason}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="netlab-relay-") as tmp:
        res = run(a.seconds, a.keep or Path(tmp))
    print(f"relay: pub1 --relay at {res['relay']}")
    print(f"{'worker':8s} {'reach':9s} {'shared':>6s}  paths")
    for n, w in res["workers"].items():
        print(f"{n:8s} {w['reachability']:9s} {w['shared_commits']:6d}  {w['paths']}")
    print(f"rounds all three committed: {res['rounds_all_committed']}, bit-identical: {res['bit_identical']}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: which of the p2p daemon's two relay services serves, start by start.

A relay node's p2pd (hivemind 1.1.12's) runs go-libp2p's relay service with our limits and
a second one with go-libp2p's defaults; the last to register the hop protocol serves, and
the Go scheduler decides which that is (`bagel.protocol.relay`, "two relay services"). This
starts a daemon with a relay node's flags (`install_p2pd_args`, forced public, relay on)
`--starts` times in each environment, asks it for a reservation from a throwaway peer
(`probe_relay_limit`) and counts the answers: "ours" (`RELAY_DATA_LIMIT_BYTES`) or the
defaults (131072 bytes). The environments: the daemon as hivemind starts it, and with
`RELAY_P2PD_ENV` (one Go processor), which `start_relay_dht` uses. Loopback only; the race
is inside one process, so no test bed is needed. The host's load average is printed with
each row: the outcome depends on how busy the machine is.

    .venv/bin/python bench/relay_starts.py [--starts 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from hivemind.p2p import P2P

from bagel.protocol.relay import RELAY_DATA_LIMIT_BYTES, RELAY_P2PD_ENV, install_p2pd_args, probe_relay_limit

ENVS: dict[str, dict[str, str]] = {"hivemind's": {}, "RELAY_P2PD_ENV": RELAY_P2PD_ENV}


async def one_start(env: dict[str, str]) -> int:
    """The data limit one fresh relay daemon answers (its env: ours added to this process's)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # P2P.create hands the daemon a copy of os.environ
    try:
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], force_reachability="public", use_relay=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        return (await probe_relay_limit(p2p.peer_id.to_base58(), maddrs)).data_bytes
    finally:
        await p2p.shutdown()


async def run(starts: int) -> list[dict[str, Any]]:
    rows = []
    for name, env in ENVS.items():
        load_before = os.getloadavg()[0]
        t0 = time.monotonic()
        outcomes = [await one_start(env) for _ in range(starts)]
        ours = sum(1 for d in outcomes if d >= RELAY_DATA_LIMIT_BYTES)
        rows.append(
            {
                "env": name,
                "vars": env,
                "starts": starts,
                "ours": ours,
                "defaults": sum(1 for d in outcomes if d == 1 << 17),
                "other": starts - ours - sum(1 for d in outcomes if d == 1 << 17),
                "sequence": "".join("O" if d >= RELAY_DATA_LIMIT_BYTES else "D" for d in outcomes),
                "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "seconds": round(time.monotonic() - t0, 1),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=20, help="daemon starts per environment")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if args.starts < 1:
        print("relay_starts: --starts must be at least 1", file=sys.stderr)
        return 2
    install_p2pd_args()
    rows = asyncio.run(run(args.starts))
    print(f"{'daemon env':<16} {'starts':>6} {'ours':>5} {'defaults':>8} {'load (1 min)':>14}  sequence")
    for r in rows:
        load = f"{r['load_avg_1m'][0]}-{r['load_avg_1m'][1]}"
        print(f"{r['env']:<16} {r['starts']:>6} {r['ours']:>5} {r['defaults']:>8} {load:>14}  {r['sequence']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: what TLS pinning costs a worker, and how fast it resolves the coordinator under forgeries.

1. TLS. A real in-process coordinator, once plaintext and once over TLS with its
   self-signed certificate; one signed client. Measures the connect cost (for TLS: fetch
   and pin the certificate, then the channel's own handshake, up to the first answered
   Heartbeat) and the latency of sequential Heartbeats on an open channel.
2. Discovery. A non-validating bootstrap node holds the genuine coordinator record and,
   next to it, a forgery expiring in a day; a validating worker DHT bootstrapped from it
   resolves the coordinator by asking the join string's peer directly, or by hivemind's
   iterative lookup alone (which drops the node's whole answer because of the forgery).

Prints a table; `--json FILE` writes the figures. Never asserted in tests.

    python bench/tls_and_discovery.py [--heartbeats N] [--connects N] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bagel.coordinator.core.records import CellConfig
from bagel.coordinator.daemon import start_coordinator
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.identity import Identity
from bagel.protocol.runspec import load_spec

SPEC = load_spec(Path(__file__).resolve().parents[1] / "examples" / "digits-2x2.toml")
PROFILE = pb.WorkerProfile(name="bench", device_kind="cpu", vram_bytes=8 << 30, num_devices=1)
PEER_ID = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def _cells() -> list[CellConfig]:
    return [CellConfig(cell_id=c, memory_bytes=1 << 30) for c in SPEC.cell_ids]  # skips loading the dataset


def _ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "p50_ms": 1000 * statistics.median(xs),
        "p99_ms": 1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))],
        "mean_ms": 1000 * statistics.fmean(xs),
    }


async def _tls_point(tls: bool, heartbeats: int, connects: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        h = await start_coordinator(SPEC, Path(d), cells=_cells(), tick_ms=250, tls=tls)
        target = f"127.0.0.1:{h.port}"
        try:
            # untimed warm-up (first-use costs of the channel machinery, lazy imports)
            warm = await CoordinatorClient.connect(
                target, Identity.generate(), SPEC.run.id, tls_fingerprint=h.tls_fingerprint
            )
            async with warm as c:
                await c.register(PROFILE, pb.PeerAddress(peer_id=PEER_ID, maddrs=["/ip4/127.0.0.1/tcp/1"]))
                for _ in range(50):
                    await c.heartbeat(pb.PHASE_IDLE)
            connect_s: list[float] = []
            for _ in range(connects):
                ident = Identity.generate()
                t0 = time.perf_counter()
                client = await CoordinatorClient.connect(target, ident, SPEC.run.id, tls_fingerprint=h.tls_fingerprint)
                async with client as c:
                    await c.register(PROFILE, pb.PeerAddress(peer_id=PEER_ID, maddrs=["/ip4/127.0.0.1/tcp/1"]))
                    connect_s.append(time.perf_counter() - t0)
            ident = Identity.generate()
            client = await CoordinatorClient.connect(target, ident, SPEC.run.id, tls_fingerprint=h.tls_fingerprint)
            hb_s: list[float] = []
            async with client as c:
                await c.register(PROFILE, pb.PeerAddress(peer_id=PEER_ID, maddrs=["/ip4/127.0.0.1/tcp/1"]))
                for _ in range(heartbeats):
                    t0 = time.perf_counter()
                    await c.heartbeat(pb.PHASE_IDLE)
                    hb_s.append(time.perf_counter() - t0)
        finally:
            await h.stop(0)
    return {
        "transport": "tls (pinned)" if tls else "plaintext",
        "connect": _ms(connect_s),
        "heartbeat": _ms(hb_s),
        "connects": connects,
        "heartbeats": heartbeats,
    }


async def _discovery_point(timeout_s: float) -> dict[str, Any]:
    import hivemind
    from hivemind.utils import get_dht_time

    from bagel.protocol.discovery import (
        CoordinatorRecord,
        CoordinatorRecordValidator,
        coordinator_key,
        lookup_coordinator,
        publish_coordinator,
        sign_record,
    )
    from bagel.protocol.joinstring import make_join_string, parse_join_string

    coord, evil = Identity.generate(), Identity.generate()
    run = SPEC.run.id
    dhts = []
    out: dict[str, Any] = {}
    try:
        bootstrap = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        dhts.append(bootstrap)
        maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
        info = parse_join_string(make_join_string(run, coord.public_key, maddrs))
        await publish_coordinator(bootstrap, coord, run_id=run, endpoint="127.0.0.1:7000", spec_hash=SPEC.spec_hash)
        now = get_dht_time()
        forged = CoordinatorRecord("6.6.6.6:1", run, SPEC.spec_hash, evil.public_key, now, now + 86400)
        await bootstrap.store(
            coordinator_key(run),
            sign_record(forged, evil),
            expiration_time=now + 86400,
            subkey=evil.public_key.hex(),
            return_future=True,
        )
        worker = hivemind.DHT(
            start=True,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=maddrs,
            record_validators=[CoordinatorRecordValidator(run, coord.public_key)],
        )
        dhts.append(worker)
        for direct in (True, False):
            t0 = time.perf_counter()
            record = None
            while record is None and time.perf_counter() - t0 < timeout_s:
                record, _ = await lookup_coordinator(worker, info, direct=direct)
                if record is None:
                    await asyncio.sleep(0.2)
            name = "join-string peers first" if direct else "iterative lookup only"
            out[name] = {"resolved": record is not None, "seconds": time.perf_counter() - t0}
    finally:
        for dht in reversed(dhts):
            dht.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heartbeats", type=int, default=500, help="sequential heartbeats per transport")
    p.add_argument("--connects", type=int, default=20, help="fresh connections per transport")
    p.add_argument("--resolve-timeout-s", type=float, default=25.0, help="give up resolving after this long")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the figures as JSON")
    args = p.parse_args(argv)

    # each transport twice, interleaved, so drift in the machine's load shows as disagreement between repeats
    points = [asyncio.run(_tls_point(tls, args.heartbeats, args.connects)) for tls in (False, True, False, True)]
    print(f"{'transport':>14} {'connect p50 ms':>14} {'connect p99 ms':>14} {'hb p50 ms':>10} {'hb p99 ms':>10}")
    for pt in points:
        c, hb = pt["connect"], pt["heartbeat"]
        print(
            f"{pt['transport']:>14} {c['p50_ms']:14.2f} {c['p99_ms']:14.2f} {hb['p50_ms']:10.2f} {hb['p99_ms']:10.2f}"
        )
    discovery = asyncio.run(_discovery_point(args.resolve_timeout_s))
    print(f"\n{'resolution with a day-long forgery next to the record':<56} {'resolved':>8} {'seconds':>8}")
    for name, r in discovery.items():
        print(f"{name:<56} {str(r['resolved']):>8} {r['seconds']:8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"tls": points, "discovery": discovery}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

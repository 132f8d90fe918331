"""Benchmark: what a `WatchInstruction` costs the coordinator, against a heartbeat.

A real coordinator (`start_coordinator` on port 0, its own data dir) with one registered
worker; the requests are signed beforehand by that worker's client and handed to the
application object the servicer calls (`CoordinatorApp.verify`, then `apply` or `watch`,
then the reply serialized), so what is timed is the coordinator's own work per request:
the envelope's Ed25519 check, validation, the core, the reply. gRPC's own per-call cost
comes on top of both alike and is left out. Three paths, `--requests` each:

- heartbeat: an IDLE heartbeat that changes nothing (the hot path);
- watch, answered at once: a `known_tag` that is not the current one;
- envelope only: `Verifier.verify` of a signed watch, the share both pay for the signature.

    python bench/watch_cost.py [--requests 3000] [--json watch_cost.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the cluster tests' spec and cell helpers

from bagel.coordinator import translate as wire  # noqa: E402
from bagel.coordinator.daemon import start_coordinator  # noqa: E402
from bagel.protocol import bagel_pb2 as pb  # noqa: E402
from bagel.protocol.client import CoordinatorClient  # noqa: E402
from bagel.protocol.identity import Identity  # noqa: E402
from bagel.protocol.runspec import parse_spec  # noqa: E402

from simworkers import (  # type: ignore[import-not-found]  # noqa: E402  (tests/ on the path)
    cluster_spec_text,
    sim_peer,
    sim_profile,
    uniform_cells,
)


async def measure(n: int) -> dict[str, Any]:
    spec = parse_spec(cluster_spec_text(heartbeat_s=30.0, lease_s=60.0, min_replicas=1))
    with tempfile.TemporaryDirectory(prefix="watch-cost-") as tmp:
        h = await start_coordinator(
            spec, Path(tmp) / "coord", listen="127.0.0.1:0", cells=uniform_cells(spec.cell_ids), tick_ms=50
        )
        c = CoordinatorClient(f"127.0.0.1:{h.port}", Identity.generate(), spec.run.id, timeout_s=5.0)
        try:
            await c.register(sim_profile(spec.cell_ids, name="bench"), sim_peer(c.worker_id))
            await c.heartbeat(pb.PHASE_IDLE)
            app = h.app
            # one worker sends them all: its own rate limit is not what is measured
            app.admission.per_key.rate = app.admission.per_key.burst = 1e12
            hbs = [c.sign("Heartbeat", pb.HeartbeatRequest(phase=pb.PHASE_IDLE)) for _ in range(n)]
            watches = [c.sign("WatchInstruction", pb.WatchInstructionRequest(known_tag=1, wait_ms=1)) for _ in range(n)]
            bare = [c.sign("WatchInstruction", pb.WatchInstructionRequest(known_tag=1, wait_ms=1)) for _ in range(n)]

            t = time.perf_counter()
            for s in hbs:
                v = app.verify(s, "Heartbeat")
                out = await app.apply(wire.heartbeat_event(v.worker_id, v.message))
                pb.HeartbeatResponse(
                    lease_expires_unix_ms=out.lease_expires_ms or 0, instruction=wire.instruction_to_pb(out.instruction)
                ).SerializeToString()
            heartbeat_s = time.perf_counter() - t

            t = time.perf_counter()
            for s in watches:
                v = app.verify(s, "WatchInstruction")
                ins, changed = await app.watch(v.worker_id, v.message.known_tag, v.message.wait_ms)
                pb.WatchInstructionResponse(instruction=ins, changed=changed).SerializeToString()
            watch_s = time.perf_counter() - t

            t = time.perf_counter()
            for s in bare:
                app.verifier.verify(s, "WatchInstruction", app.clock())
            envelope_s = time.perf_counter() - t
        finally:
            await c.close()
            await h.stop()
    return {
        "requests": n,
        "heartbeat_us": 1e6 * heartbeat_s / n,
        "watch_us": 1e6 * watch_s / n,
        "envelope_us": 1e6 * envelope_s / n,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="requests per path (default: 3000)")
    ap.add_argument("--json", type=Path, default=Path("watch_cost.json"))
    a = ap.parse_args()
    got = asyncio.run(measure(a.requests))
    print(f"\ncoordinator work per request ({got['requests']} each, in-process, gRPC left out)\n")
    print(f"{'path':36s} {'us':>8s}")
    print(f"{'heartbeat that changes nothing':36s} {got['heartbeat_us']:8.1f}")
    print(f"{'watch answered at once':36s} {got['watch_us']:8.1f}")
    print(f"{'envelope check alone (Ed25519)':36s} {got['envelope_us']:8.1f}")
    a.json.write_text(json.dumps(got, indent=2))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Heartbeat latency while the coordinator is abused: a GetStatus flood (unsigned, and
signed by registered workers, who see the detailed view) and idle upload streams.

A coordinator runs as its own process with N registered workers (long leases, so they
stay active without heartbeating); probe workers heartbeat every 50 ms (spread over a
few keys, under the per-key rate limit) and record each round-trip. Phases, each
`--seconds` long: baseline, then each abuse from a separate process (so the abuser's CPU
is not the probe's), then after. The abuser counts what the coordinator answered.

    python bench/abuse.py [--workers 3000] [--seconds 5] [--json out.json]

Prints a table of heartbeat p50/p99 per phase and the coordinator's mean event-loop lag
(its own tick timer's lateness, from /metrics: what every queued request waited, free of
the probe's CPU contention); `--json FILE` writes the figures. Never asserted in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol.envelope import sign_request
from bagel.protocol.grpc_options import channel_options
from bagel.protocol.identity import Identity

RUN = "abusebench"
SPEC = """
[run]
id = "abusebench"

[data]
source = "digits"
clusters = 2

[cells]
timestep_ranges = 2
router = true

[schedule]
lease_s = 600.0
heartbeat_s = 2.0

# registration is not what is measured here: no proof of work, and the fleet registers
# from one address; the GetStatus and stream limits are the defaults
[security]
pow_bits = 0
ip_rate_per_s = 1000000.0
ip_burst = 1000000
register_rate_per_s = 1000000.0
register_burst = 1000000
"""
PROFILE = pb.WorkerProfile(name="bench", device_kind="cpu", vram_bytes=8 << 30, num_devices=1)
PEER = pb.PeerAddress(peer_id="12D3KooW" + "A" * 44, maddrs=["/ip4/127.0.0.1/tcp/1"])
PROBES = 4
PROBE_PERIOD_S = 0.05


def _serve(spec: Path, data: Path) -> tuple[subprocess.Popen[str], str, str]:
    cmd = [sys.executable, "-m", "bagel.coordinator", "serve", "--run", str(spec), "--data-dir", str(data)]
    cmd += ["--listen", "127.0.0.1:0", "--no-dht", "--log-level", "WARNING", "--metrics-listen", "127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    endpoint = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("listening:"):
            endpoint = line.split(":", 1)[1].strip()
        elif line.startswith("metrics:") and endpoint:
            return proc, endpoint, line.split(":", 1)[1].strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("the coordinator did not start")


def _loop_lag(url: str) -> tuple[float, float]:
    """(count, sum) of the coordinator's event-loop lag histogram (its tick timer's lateness)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith("bagel_event_loop_lag_seconds_count"):
            count = float(line.split()[-1])
        elif line.startswith("bagel_event_loop_lag_seconds_sum"):
            total = float(line.split()[-1])
    return count, total


async def _register(stub: Any, ident: Identity) -> None:
    req = pb.RegisterRequest(profile=PROFILE, peer=PEER)
    await stub.Register(sign_request(ident, req, run_id=RUN, method="Register"), timeout=60)


async def _register_fleet(endpoint: str, identities: list[Identity]) -> None:
    channels = [grpc.aio.insecure_channel(endpoint, options=channel_options()) for _ in range(4)]
    stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with sem:
            await _register(stubs[i % 4], identities[i])

    await asyncio.gather(*(one(i) for i in range(len(identities))))
    for c in channels:
        await c.close()


async def _probe(endpoint: str, probes: list[Identity], seconds: float) -> list[float]:
    """Heartbeat round-trips (ms) for `seconds`, probes taking turns."""
    out: list[float] = []
    async with grpc.aio.insecure_channel(endpoint, options=channel_options()) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            ident = probes[i % len(probes)]
            i += 1
            signed = sign_request(ident, pb.HeartbeatRequest(phase=pb.PHASE_IDLE), run_id=RUN, method="Heartbeat")
            t0 = time.perf_counter()
            try:
                await stub.Heartbeat(signed, timeout=30)
                out.append((time.perf_counter() - t0) * 1000)
            except grpc.aio.AioRpcError as e:
                out.append(float("nan") if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED else 30_000.0)
            await asyncio.sleep(PROBE_PERIOD_S)
    return out


# ---------------------------------------------------------------------------- abuser process


async def _abuse(endpoint: str, kind: str, seconds: float, keys: list[bytes]) -> dict[str, int]:
    counts: dict[str, int] = {}
    end = time.monotonic() + seconds
    idents = [Identity.from_private_bytes(k) for k in keys]

    def note(code: grpc.StatusCode) -> None:
        counts[code.name] = counts.get(code.name, 0) + 1

    async with grpc.aio.insecure_channel(endpoint, options=channel_options()) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        if kind in ("status", "status-signed"):

            async def flood(j: int) -> None:
                while time.monotonic() < end:
                    req = pb.GetStatusRequest()
                    if kind == "status-signed":
                        ident = idents[j % len(idents)]
                        req.auth.CopyFrom(sign_request(ident, pb.StatusAuthRequest(), run_id=RUN, method="GetStatus"))
                    try:
                        await stub.GetStatus(req, timeout=30)
                        note(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as e:
                        note(e.code())

            await asyncio.gather(*(flood(j) for j in range(32)))
        elif kind == "idle-uploads":
            never = asyncio.Event()

            async def silent() -> Any:
                await never.wait()
                yield pb.CheckpointUploadChunk()

            async def hold() -> None:
                while time.monotonic() < end:
                    try:
                        await stub.UploadCheckpoint(silent(), timeout=max(1.0, end - time.monotonic()))
                        note(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as e:
                        note(e.code())

            await asyncio.gather(*(hold() for _ in range(200)))
    return counts


def _run_abuser(endpoint: str, kind: str, seconds: float, keys: list[Identity]) -> subprocess.Popen[str]:
    arg = json.dumps(
        {"endpoint": endpoint, "kind": kind, "seconds": seconds, "keys": [k.private_bytes().hex() for k in keys]}
    )
    return subprocess.Popen([sys.executable, __file__, "--abuser", arg], stdout=subprocess.PIPE, text=True)


def _stats(ms: list[float]) -> dict[str, float]:
    good = sorted(x for x in ms if x == x)
    if not good:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "errors": len(ms)}
    return {
        "n": len(good),
        "p50_ms": statistics.median(good),
        "p99_ms": good[min(len(good) - 1, int(0.99 * len(good)))],
        "errors": len(ms) - len(good),
    }


def run(workers: int, seconds: float, upload_idle_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.toml"
        spec.write_text(SPEC + f"upload_idle_s = {upload_idle_s}\n")
        proc, endpoint, metrics = _serve(spec, Path(tmp) / "d")
        try:
            fleet = [Identity.generate() for _ in range(workers)]
            probes = [Identity.generate() for _ in range(PROBES)]
            t0 = time.perf_counter()
            asyncio.run(_register_fleet(endpoint, fleet + probes))
            reg_s = time.perf_counter() - t0
            phases: list[dict[str, Any]] = []
            for kind in ("baseline", "status", "status-signed", "idle-uploads", "after"):
                abuser = None
                if kind not in ("baseline", "after"):
                    abuser = _run_abuser(endpoint, kind, seconds + 1.0, fleet[:64])
                    time.sleep(1.0)  # let the abuse start
                lag0 = _loop_lag(metrics)
                ms = asyncio.run(_probe(endpoint, probes, seconds))
                lag1 = _loop_lag(metrics)
                ticks = lag1[0] - lag0[0]
                mean_lag_ms = (lag1[1] - lag0[1]) / ticks * 1000 if ticks else float("nan")
                counts: dict[str, int] = {}
                if abuser is not None:
                    out, _ = abuser.communicate(timeout=120)
                    counts = json.loads(out.strip().splitlines()[-1])
                phases.append({"phase": kind, **_stats(ms), "loop_lag_mean_ms": mean_lag_ms, "abuser_answers": counts})
        finally:
            proc.terminate()
            proc.wait(30)
    return {"workers": workers, "seconds": seconds, "register_s": reg_s, "phases": phases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each phase")
    ap.add_argument("--upload-idle-s", type=float, default=2.0, help="security.upload_idle_s of the run")
    ap.add_argument("--json", type=Path, help="write the results as JSON to this file")
    ap.add_argument("--abuser", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.abuser:
        a = json.loads(args.abuser)
        keys = [bytes.fromhex(k) for k in a["keys"]]
        print(json.dumps(asyncio.run(_abuse(a["endpoint"], a["kind"], a["seconds"], keys))))
        return 0
    res = run(args.workers, args.seconds, args.upload_idle_s)
    print(f"{res['workers']} registered workers (in {res['register_s']:.1f} s); heartbeat round-trips per phase")
    print(f"{'phase':>14} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'loop lag ms':>11}  abuser got")
    for p in res["phases"]:
        print(
            f"{p['phase']:>14} {p['n']:>5} {p['p50_ms']:>8.2f} {p['p99_ms']:>8.2f} {p['errors']:>6} "
            f"{p['loop_lag_mean_ms']:>11.2f}  {p['abuser_answers'] or ''}"
        )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

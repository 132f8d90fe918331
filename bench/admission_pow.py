"""What the per-registration proof of work costs: registrations per second per core,
with and without it, against a real coordinator.

A coordinator runs as its own process (`bagel-coordinator serve --no-dht`) with
`security.pow_bits` = B; this process registers N fresh identities one after another
through `CoordinatorClient.register` (AdmissionChallenge, solve, Register), and counts its
own CPU time: registrations per client core = N / CPU seconds (what an attacker minting
identities pays per core, with this Python solver; a native or GPU solver is faster, see
the note printed below). The server's side is one hash: timed separately.

    python bench/admission_pow.py [--bits 0 16 20] [--n 200] [--json out.json]

Prints a table; `--json FILE` writes the figures. Never asserted in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.identity import Identity
from bagel.protocol.pow import check_pow, solve_pow
from bagel.protocol.runspec import SecuritySection

SPEC = """
[run]
id = "powbench"

[data]
source = "digits"
clusters = 1

[cells]
timestep_ranges = 1
router = false

[schedule]
lease_s = 600.0
heartbeat_s = 1.0

# rate limits out of the way: one process registers every identity from one address
[security]
pow_bits = {bits}
ip_rate_per_s = 1000000.0
ip_burst = 1000000
register_rate_per_s = 1000000.0
register_burst = 1000000
"""


def _serve(spec: Path, data: Path) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "bagel.coordinator", "serve", "--run", str(spec), "--data-dir", str(data)]
    cmd += ["--listen", "127.0.0.1:0", "--no-dht", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("listening:"):
            return proc, line.split(":", 1)[1].strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("the coordinator did not start")


async def _register_many(endpoint: str, n: int) -> dict[str, float]:
    profile = pb.WorkerProfile(name="bench", device_kind="cpu", vram_bytes=8 << 30, num_devices=1)
    peer = pb.PeerAddress(peer_id="12D3KooW" + "A" * 44, maddrs=["/ip4/127.0.0.1/tcp/1"])
    identities = [Identity.generate() for _ in range(n)]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for ident in identities:
        async with CoordinatorClient(endpoint, ident, "powbench") as c:
            await c.register(profile, peer)
    return {"cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0}


def _verify_us(bits: int, reps: int = 20_000) -> float:
    key = Identity.generate().public_key
    ch = os.urandom(32)
    nonce = solve_pow(ch, "powbench", key, min(bits, 12))
    t0 = time.perf_counter()
    for _ in range(reps):
        check_pow(ch, "powbench", key, nonce, bits)
    return (time.perf_counter() - t0) / reps * 1e6


def run(bits_list: list[int], n: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bits in bits_list:
            spec = Path(tmp) / f"spec{bits}.toml"
            spec.write_text(SPEC.format(bits=bits))
            proc, endpoint = _serve(spec, Path(tmp) / f"d{bits}")
            try:
                count = n if bits < 18 else max(4, n // 20)
                got = asyncio.run(_register_many(endpoint, count))
            finally:
                proc.terminate()
                proc.wait(30)
            rows.append(
                {
                    "pow_bits": bits,
                    "registrations": count,
                    "wall_s": got["wall_s"],
                    "client_cpu_s": got["cpu_s"],
                    "registrations_per_s_per_core": count / got["cpu_s"],
                    "expected_hashes": 2**bits if bits else 0,
                    "server_check_us": _verify_us(bits),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = SecuritySection().pow_bits
    ap.add_argument("--bits", type=int, nargs="+", default=[0, default, 20], help="difficulties to run")
    ap.add_argument("--n", type=int, default=200, help="registrations per difficulty (fewer above 17 bits)")
    ap.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    rows = run(args.bits, args.n)
    print(f"default security.pow_bits = {default}")
    head = f"{'pow_bits':>8} {'regs':>6} {'wall s':>8} {'client cpu s':>12} {'regs/s/core':>12} {'server check us':>16}"
    print(head)
    for r in rows:
        print(
            f"{r['pow_bits']:>8} {r['registrations']:>6} {r['wall_s']:>8.2f} {r['client_cpu_s']:>12.2f} "
            f"{r['registrations_per_s_per_core']:>12.1f} {r['server_check_us']:>16.1f}"
        )
    print(
        "note: the solver is CPython hashlib (~1M sha256/s per core); native code does ~10-20x that and a GPU "
        "far more, so the figure is the cost to an attacker using this client, an upper bound on the protection."
    )
    if args.json:
        args.json.write_text(json.dumps({"default_pow_bits": default, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

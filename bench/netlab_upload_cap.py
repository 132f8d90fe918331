"""Benchmark: does `bagel-worker join --max-upload-mbps X` cap what a worker really sends?

On the network test bed (sim/netlab/, root only): a real coordinator on the public segment
and two real public workers, each on a link shaped with tbf to `--link` Mbit/s in both
directions, training one cell together (min_replicas = 2, so every round is a two-member
exchange). The cell is a DiT "mini" (4.2 M parameters) exchanged in fp32, about 17 MB of
pseudo-gradient per member and round, so an exchange lasts seconds, not milliseconds.

Two measurements per worker, for each setting (`--cap` X, and uncapped as the control that
shows the link itself would carry more):
- the worker's own counters: each committed round's `bytes_sent` over its `exchange_s`
  (the exchange's wall time, waiting included);
- the link: a sampler inside the worker's namespace reads `eth0`'s `tx_bytes` every 50 ms
  (everything the worker sends: exchange, heartbeats, DHT, TCP/IP headers); the table
  shows the largest rate over any 1 s window and over any 5 s window of the run.

A second scenario, `--stall`, checks the cap where bursts come from: a paced sender (the
worker's own `framing.write_frame` under its `UploadPacer`, over a real hivemind P2P stream)
and a receiver that reads nothing for its first 8 s, so what the pacer lets go meanwhile
waits below it; run with the worker's buffer shrinking (as shipped) and without it.

Prints tables; `--json FILE` writes the figures. Not a test.

    sudo .venv/bin/python bench/netlab_upload_cap.py [--cap 10] [--link 100] [--rounds 3] [--json out.json]
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

SPEC = """
[run]
id = "upcap"
seed = 0

[model]
arch = "dit"
preset = "mini"
image_size = 8
channels = 1
num_classes = 10

[data]
source = "digits"
clusters = 1
holdout_fraction = 0.1

[cells]
timestep_ranges = 1
router = false

[diloco]
inner_steps = 2
group_batch = 16
max_micro_batch = 16
codec = "fp32"
error_feedback = false

[schedule]
min_replicas = 2
max_replicas = 2
lease_s = 20.0
heartbeat_s = 1.0
deadline_slack = 3.0
min_round_s = 1.0

[checkpoint]
every_rounds = 1000
keep = 2
"""

SAMPLER = """
import sys, time
path = "/sys/class/net/eth0/statistics/tx_bytes"
while True:
    with open(path) as f:
        print(f"{time.time():.3f} {f.read().strip()}", flush=True)
    time.sleep(0.05)
"""

NODES = ("pub1", "pub2")


def _shared(log: Path) -> list[dict[str, Any]]:
    return [e for e in events(log, "committed") if int(e.get("contributors", 0)) >= 2]


def max_window_mbps(samples: list[tuple[float, int]], window_s: float) -> float:
    """The largest average rate over any window of `window_s` between two samples."""
    best, j = 0.0, 0
    for i in range(len(samples)):
        while j < i and samples[i][0] - samples[j][0] > window_s:
            j += 1
        if j > 0:  # the window [j-1, i] spans at least window_s
            t0, b0 = samples[j - 1]
            t1, b1 = samples[i]
            if t1 - t0 >= window_s:
                best = max(best, (b1 - b0) * 8 / (t1 - t0) / 1e6)
    return best


def run(cap: float | None, link: float, rounds: int, root: Path, timeout_s: float) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "spec.toml"
    spec.write_text(SPEC)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    py = sys.executable
    with NetLab(tag="vb", homes=0, per_home=0, public=2) as lab:
        for node in NODES:
            lab.shape(node, rate_mbit=link)

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
        for node in NODES:
            start(node, [py, "-c", SAMPLER], root / f"{node}.tx")
            argv = [py, "-m", "bagel.worker", "join", join, "--data-dir", str(root / node), "--log-json",
                    "--name", node, "--reduce-timeout-s", "120", "--cpu-threads", "1"]  # fmt: skip
            if cap is not None:
                argv += ["--max-upload-mbps", str(cap)]
            start(node, argv, root / f"{node}.log")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and min(len(_shared(root / f"{n}.log")) for n in NODES) < rounds:
            time.sleep(1.0)
    out: dict[str, Any] = {"cap_mbps": cap, "link_mbps": link, "workers": {}}
    for n in NODES:
        commits = _shared(root / f"{n}.log")
        per_round = [
            e["bytes_sent"] * 8 / e["exchange_s"] / 1e6
            for e in commits
            if e.get("exchange_s", 0) > 0 and e["bytes_sent"]
        ]
        samples = _tx_samples(root / f"{n}.tx")
        out["workers"][n] = {
            "rounds": len(commits),
            "bytes_sent_per_round": [e["bytes_sent"] for e in commits],
            "exchange_s": [e.get("exchange_s") for e in commits],
            "counter_mbps_per_round": [round(r, 3) for r in per_round],
            "counter_mbps_max": round(max(per_round), 3) if per_round else None,
            "link_mbps_max_1s": round(max_window_mbps(samples, 1.0), 3),
            "link_mbps_max_5s": round(max_window_mbps(samples, 5.0), 3),
        }
    return out


STALL_S = 8.0
STALL_BYTES = 30 << 20


async def _peer(argv: list[str]) -> None:
    """`_peer recv ADDR ADDR_FILE` or `_peer send TARGET MBPS SHRINK` (the --stall scenario)."""
    import asyncio

    from hivemind.p2p import P2P, PeerID

    from bagel.worker import framing, pacing

    if argv[0] == "recv":
        p2p = await P2P.create(host_maddrs=[f"/ip4/{argv[1]}/tcp/7100"])

        async def handler(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(STALL_S)
            n = 0
            while b := await reader.read(1 << 20):
                n += len(b)
            print(json.dumps({"received": n}), flush=True)

        await p2p.add_binary_stream_handler("stall", handler)
        maddr = (await p2p.get_visible_maddrs())[0]
        Path(argv[2]).write_text(f"{maddr}/p2p/{p2p.peer_id.to_base58()}")
        await asyncio.sleep(300)
        return
    target, mbps, shrink = argv[1], float(argv[2]), argv[3] == "1"
    if not shrink:
        framing._shrink_buffers = lambda writer: None  # the control: the pacer alone
    pacing.install(pacing.UploadPacer.from_mbps(mbps))
    p2p = await P2P.create(initial_peers=[target])
    _, _, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(target.rsplit("/", 1)[1]), "stall")
    t0 = time.time()
    for _ in range(STALL_BYTES >> 20):
        await framing.write_frame(writer, bytes(1 << 20))
    writer.close()
    print(json.dumps({"sent": STALL_BYTES, "s": round(time.time() - t0, 2)}), flush=True)
    await asyncio.sleep(3.0)
    await p2p.shutdown()


def _tx_samples(path: Path) -> list[tuple[float, int]]:
    out = []
    for line in path.read_text().splitlines():
        t, _, b = line.partition(" ")
        if b.isdigit():
            out.append((float(t), int(b)))
    return out


def run_stall(cap: float, link: float, shrink: bool, root: Path) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    py, me = sys.executable, str(Path(__file__).resolve())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with NetLab(tag="vs", homes=0, per_home=0, public=2) as lab:
        for node in NODES:
            lab.shape(node, rate_mbit=link)
        addr = root / "addr"
        with open(root / "recv.log", "w") as f:
            lab.run_in(
                "pub2",
                [py, me, "_peer", "recv", lab.ip("pub2"), str(addr)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + 60
        while not addr.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        with open(root / "pub1.tx", "w") as f:
            lab.run_in("pub1", [py, "-c", SAMPLER], stdout=f)
        with open(root / "send.log", "w") as f:
            sender = lab.run_in(
                "pub1",
                [py, me, "_peer", "send", addr.read_text(), str(cap), "1" if shrink else "0"],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
            )
        sender.wait(timeout=300)
        time.sleep(1.0)
    samples = _tx_samples(root / "pub1.tx")
    bins = [(b1 - b0) * 8 / (t1 - t0) / 1e6 for (t0, b0), (t1, b1) in zip(samples, samples[1:], strict=False)]
    return {
        "cap_mbps": cap,
        "link_mbps": link,
        "shrink_buffers": shrink,
        "sent": (root / "send.log").read_text().strip().splitlines()[-1:],
        "link_mbps_max_50ms": round(max(bins), 3) if bins else None,
        "link_mbps_max_1s": round(max_window_mbps(samples, 1.0), 3),
        "link_mbps_max_5s": round(max_window_mbps(samples, 5.0), 3),
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_peer":
        import asyncio

        asyncio.run(_peer(sys.argv[2:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap", type=float, default=10.0, help="--max-upload-mbps of both workers (default 10)")
    ap.add_argument("--link", type=float, default=100.0, help="tbf rate of each worker's link, Mbit/s (default 100)")
    ap.add_argument("--rounds", type=int, default=3, help="two-member rounds to commit per setting (default 3)")
    ap.add_argument("--timeout-s", type=float, default=400.0)
    ap.add_argument("--no-control", action="store_true", help="skip the uncapped control run")
    ap.add_argument("--stall", action="store_true", help="only the stalled-receiver scenario (see the docstring)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="keep logs and data dirs here (default: a temporary folder)")
    a = ap.parse_args()
    reason = missing_prerequisite()
    if reason:
        print(f"netlab_upload_cap: {reason}", file=sys.stderr)
        return 1
    results = []
    if a.stall:
        with tempfile.TemporaryDirectory(prefix="netlab-stall-") as tmp:
            base = a.keep or Path(tmp)
            results = [run_stall(a.cap, a.link, shrink, base / f"shrink-{int(shrink)}") for shrink in (True, False)]
        print(
            f"{'cap Mbit/s':>10s} {'link':>5s} {'small buffers':>13s} {'max 50 ms':>9s} {'max 1 s':>8s} {'max 5 s':>8s}"
        )
        for r in results:
            print(
                f"{r['cap_mbps']:10g} {r['link_mbps']:5.0f} {str(r['shrink_buffers']):>13s} "
                f"{r['link_mbps_max_50ms'] or 0:9.2f} {r['link_mbps_max_1s']:8.2f} {r['link_mbps_max_5s']:8.2f}"
            )
        if a.json:
            a.json.write_text(json.dumps(results, indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="netlab-upcap-") as tmp:
        base = a.keep or Path(tmp)
        caps: list[float | None] = [a.cap] if a.no_control else [a.cap, None]
        for cap in caps:
            name = f"cap-{cap:g}" if cap is not None else "uncapped"
            results.append(run(cap, a.link, a.rounds, base / name, a.timeout_s))
    print(
        f"{'cap Mbit/s':>10s} {'link':>5s} {'worker':6s} {'rounds':>6s} {'MB/round':>8s} {'exch s':>7s} "
        f"{'counters max':>12s} {'link max 1s':>11s} {'link max 5s':>11s}"
    )
    for r in results:
        for n, w in r["workers"].items():
            mb = sum(w["bytes_sent_per_round"]) / max(1, len(w["bytes_sent_per_round"])) / 1e6
            ex = [x for x in w["exchange_s"] if x]
            print(
                f"{(str(r['cap_mbps']) if r['cap_mbps'] else '-'):>10s} {r['link_mbps']:5.0f} {n:6s} {w['rounds']:6d} "
                f"{mb:8.2f} {sum(ex) / max(1, len(ex)):7.2f} {w['counter_mbps_max'] or 0:12.3f} "
                f"{w['link_mbps_max_1s']:11.3f} {w['link_mbps_max_5s']:11.3f}"
            )
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

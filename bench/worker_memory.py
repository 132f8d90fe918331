"""Benchmark: how much memory does a real worker hold for its cell, against what the
coordinator sizes the cell at?

The coordinator gives a worker only cells whose closed-form memory fits (`models.experts.
cell_memory_bytes` on the device: DEVICE_COPIES float32 copies of the parameters plus the
activations of one micro-batch; `cell_host_bytes` on the host; on a CPU worker both in its
RAM, `bagel.protocol.cellmemory`). This runs the real thing and measures it: a
real `bagel-coordinator serve` and `--workers` real `bagel-worker join` processes on
loopback, CPU only, one cell, for `--rounds` committed rounds, once with the tiny DiT and
once with a larger preset (`--preset`, DiT-S/2 by default) on the same spec otherwise. A
thread samples every worker's resident memory, and at the end each worker's peak
(`VmHWM`, the kernel's own high-water mark of the worker's main process; its DHT child
and p2pd are other processes) is read.

What the process holds besides its cell (the interpreter, torch, the DHT client, the
data) is the same for both presets, so the difference of the peaks, less the difference
of the estimated activations, divided by the difference of the parameter bytes, is the
number of float32 parameter copies a worker holds at its peak: on a CPU worker every
copy is in the same memory, the four the training device holds (weights, gradients,
AdamW's two moments) and the ones kept on the host (the committed weights, outer momentum
and average, the round's new state, the delta and the contribution's residual, the parts
it reduces in float64, the averaged update, the previous round's state kept for joiners,
the loss audit's model; `bench/exchange_memory.py` takes the exchange's share apart). The
table sets that against the estimate's copies (device and host together). Then, for the
larger preset, where each worker's memory went (from its `--log-json` events and the
sampled trace): before it built a model, while it measured its speed, the most while
training and while exchanging, and what it held after each commit, in MB and in copies of
the parameters above the first figure.

    .venv/bin/python bench/worker_memory.py [--preset S/2] [--image-size 32] [--workers 3]
        [--rounds 3] [--json out.json]

CPU only (each worker runs with one thread, `--cpu-threads 1`); a few minutes (DiT-S/2 on
16x16 with two workers: `--image-size 16 --workers 2`, about 6 minutes here). Not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bagel.models.experts import activation_bytes, cell_config, cell_host_bytes, cell_param_count
from bagel.protocol.cellmemory import DEVICE_COPIES
from bagel.protocol.runspec import parse_spec
from bagel.worker.swarm import CoordinatorProc, WorkerProc, cleanup

CELL = "k0.r0"
SPEC = """
[run]
id = "worker-memory"
seed = 0

[model]
arch = "dit"
preset = "{preset}"
image_size = {image_size}
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
inner_steps = 4
inner_lr = 0.001
group_batch = {group_batch}
max_micro_batch = {micro_batch}
codec = "int8"
error_feedback = true
aggregation = "centered_clip"

[ema]
decay = {ema}

[schedule]
min_replicas = 1
max_replicas = {workers}
lease_s = 10.0
heartbeat_s = 0.5
deadline_slack = 3.0
min_round_s = 2.0
quorum = 0.5
"""


def status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_one(preset: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Coordinator + workers on one spec until every worker committed `args.rounds` rounds."""
    text = SPEC.format(
        preset=preset,
        image_size=args.image_size,
        group_batch=args.micro_batch * args.workers,
        micro_batch=args.micro_batch,
        ema=args.ema,
        workers=args.workers,
    )
    spec = parse_spec(text)
    d = root / preset.replace("/", "_")
    d.mkdir()
    (d / "run.toml").write_text(text)
    trace: dict[str, list[tuple[float, int]]] = {}  # worker -> (unix time, resident bytes)
    stop = threading.Event()
    with cleanup([]) as procs:
        coord = CoordinatorProc.make(d / "run.toml", d / "coord", d / "coord.log")
        procs.append(coord)
        coord.start_and_wait(timeout_s=120)
        workers = [
            WorkerProc.make(
                coord.join, d / f"w{i}", d / f"w{i}.log", name=f"w{i}", extra=["--cpu-threads", "1", "--device", "cpu"]
            )
            for i in range(args.workers)
        ]
        for w in workers:
            procs.append(w)
            w.start()

        def sample() -> None:  # resident memory over time, to find the phase it peaks in
            while not stop.wait(0.02):
                for w in workers:
                    if w.alive():
                        trace.setdefault(w.name, []).append((time.time(), status_kib(w.pid, "VmRSS") * 1024))

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline:
            done = [len(w.events("committed")) for w in workers]
            if min(done) >= args.rounds:
                break
            for w in workers:
                if not w.alive():
                    raise RuntimeError(f"{w.name} exited:\n{w.log_text()[-2000:]}")
            time.sleep(0.5)
        else:
            logs = "\n".join(f"--- {w.name}\n{w.log_text()[-1500:]}" for w in workers)
            raise RuntimeError(
                f"{preset}: not every worker committed {args.rounds} rounds in {args.timeout_s:.0f} s\n{logs}"
            )
        hwm = {w.name: status_kib(w.pid, "VmHWM") * 1024 for w in workers}
        stop.set()
        t.join()
        phases = {w.name: phases_of(w.events(), trace.get(w.name, [])) for w in workers}
    params = cell_param_count(spec, CELL)
    return {
        "preset": preset,
        "params": params,
        "param_bytes": 4 * params,
        "activation_bytes": activation_bytes(cell_config(spec, CELL), args.micro_batch),
        "host_bytes": cell_host_bytes(spec, CELL),
        "peak_bytes": hwm,
        "phases": phases,
    }


# a worker's --log-json events that start and end the phases below
_STARTS = {"train": "training", "exchange": "exchange"}
_ENDS = {"ready", "exchanged", "exchange-failed", "dropped", "verdict", "committed"}


def phases_of(events: list[dict[str, Any]], trace: list[tuple[float, int]]) -> dict[str, Any]:
    """Where a worker's resident memory went: before it built a model (interpreter, torch,
    the DHT), while it measured its speed, the most while training and while exchanging,
    and after each commit (what stays between rounds)."""
    if not trace:
        return {}

    def rss_at(ts: float) -> int:
        before = [b for t, b in trace if t <= ts]
        return before[-1] if before else trace[0][1]

    def peak(t0: float, t1: float) -> int:
        return max((b for t, b in trace if t0 <= t <= t1), default=0)

    first = {e["event"]: e["ts"] for e in reversed(events)}
    out: dict[str, Any] = {
        "before_model": rss_at(first.get("reachability", trace[0][0])),
        "measuring_peak": peak(first.get("reachability", trace[0][0]), first.get("registered", trace[-1][0])),
        "training_peak": 0,
        "exchange_peak": 0,
        "after_commits": [rss_at(e["ts"]) for e in events if e["event"] == "committed"],
    }
    open_phase: tuple[str, float] | None = None
    for e in events:
        kind = e["event"]
        if open_phase is not None and (kind in _ENDS or kind in _STARTS):
            name, t0 = open_phase
            key = f"{name}_peak"
            out[key] = max(out[key], peak(t0, e["ts"]))
            open_phase = None
        if kind in _STARTS:
            open_phase = (_STARTS[kind], e["ts"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="S/2", help="the larger DiT preset (default: S/2)")
    ap.add_argument("--image-size", type=int, default=32, help="image side, both presets (default: 32)")
    ap.add_argument("--micro-batch", type=int, default=8, help="max_micro_batch and per-worker batch (default: 8)")
    ap.add_argument("--workers", type=int, default=3, help="workers in the cell (default: 3)")
    ap.add_argument("--rounds", type=int, default=3, help="committed rounds each worker waits for (default: 3)")
    ap.add_argument("--ema", type=float, default=0.9, help="[ema] decay (default: 0.9, as the demo)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per preset (default: 600)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bagel-worker-memory-") as tmp:
        small = run_one("tiny", args, Path(tmp))
        large = run_one(args.preset, args, Path(tmp))
    d_param = large["param_bytes"] - small["param_bytes"]
    d_act = large["activation_bytes"] - small["activation_bytes"]
    rows = []
    for name in sorted(large["peak_bytes"]):
        d_peak = large["peak_bytes"][name] - small["peak_bytes"][name]
        rows.append({"worker": name, "peak_difference_bytes": d_peak, "copies": (d_peak - d_act) / d_param})
    copies = sorted(r["copies"] for r in rows)
    per_copy = large["param_bytes"]
    out = {
        "small": small,
        "large": large,
        "workers": rows,
        "median_copies": copies[len(copies) // 2],
        # the coordinator's closed form on a CPU worker: the device's copies and the host's
        "estimate_copies": DEVICE_COPIES + (large["host_bytes"] - small["host_bytes"]) / d_param,
        "config": vars(args) | {"json": str(args.json) if args.json else None},
    }
    print(
        f"worker memory, real processes on CPU: {args.workers} workers, {args.rounds} committed rounds, "
        f"{args.image_size}x{args.image_size}, micro-batch {args.micro_batch}, ema {args.ema}"
    )
    print(f"{'':>10} {'params':>11} {'param MB':>9} {'act MB':>7} {'peak MB per worker':>30}")
    for r in (small, large):
        peaks = " ".join(f"{v / 1e6:9.0f}" for _, v in sorted(r["peak_bytes"].items()))
        print(
            f"{r['preset']:>10} {r['params']:>11,} {r['param_bytes'] / 1e6:9.1f} "
            f"{r['activation_bytes'] / 1e6:7.1f} {peaks:>30}"
        )
    print(
        f"float32 parameter copies held at the peak (difference of the peaks less the activations, "
        f"per parameter byte): {', '.join(f'{c:.2f}' for c in copies)} (median {out['median_copies']:.2f}); "
        f"the coordinator's estimate counts {out['estimate_copies']:.2f} (device {DEVICE_COPIES}, "
        f"host {out['estimate_copies'] - DEVICE_COPIES:.2f})"
    )
    print(f"{args.preset}, by phase: MB, and in float32 parameter copies above the worker's memory before its model")
    for name, ph in sorted(large["phases"].items()):
        if not ph:
            continue
        base = ph["before_model"]

        def cell(b: int, base: int = base) -> str:
            return f"{b / 1e6:6.0f} ({(b - base) / per_copy:5.1f})"

        commits = ", ".join(cell(b) for b in ph["after_commits"])
        print(
            f"  {name}: before the model {base / 1e6:.0f}; measuring {cell(ph['measuring_peak'])}; "
            f"training {cell(ph['training_peak'])}; exchange {cell(ph['exchange_peak'])}; after each commit {commits}"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: does overlapping the exchange with the next round's compute bring the round
time from compute + exchange down to max(compute, exchange)? Real processes on shaped links.

On the network test bed (sim/netlab/, root only), a real `bagel-coordinator serve` and two
real `bagel-worker join` processes on the direct path of `bench/netlab_rounds.py` (a home
worker behind its NAT and a public one), every worker's link capped by tbf, the tiny DiT
cell with int8 pseudo-gradients. The same configuration runs with `[diloco] overlap` "off"
and "delayed", alternately (`--repeats` pairs), each on a fresh bed for `--seconds`.

Measured per worker from its `--log-json` events after both registered: the round time (the
median interval between consecutive commits with both contributing), the round's compute
(the `ready` events' `compute_s`: with overlap, the steps trained ahead and the rest
together) and the exchange (`comm_s` of the commits). The figure of merit is where the
round lands between the two bounds: (round - max) / (sum - max), where sum = compute +
exchange and max = max(compute, exchange); 1 is no overlap at all, 0 is a perfect one.
Fixed costs that neither bound counts (the freeze, the verdict, heartbeats) keep it above 0.

`--throttle` slows both workers' steps (a sleep per step, no extra CPU) so that the compute
is about the exchange's time on these links, where overlap can gain the most.

    sudo .venv/bin/python bench/overlap_rounds.py [--seconds 60] [--rate 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bagel.sim.netlab.bed import missing_prerequisite
from bagel.sim.netlab.runs import tiny_run_spec
from bagel.sim.netlab.topology import TopologyError, check_tag

# the bench next to this one, which runs one configuration on a fresh bed
sys.path.insert(0, str(Path(__file__).resolve().parent))
measure = importlib.import_module("netlab_rounds").measure

MODES = ("off", "delayed")


def spec_for(mode: str) -> str:
    text = tiny_run_spec("overlap-rounds", max_replicas=2)
    out = text.replace("error_feedback = true\n", f'error_feedback = true\noverlap = "{mode}"\n')
    assert out != text
    return out


def summarise(got: dict[str, Any]) -> dict[str, Any]:
    w = list(got["workers"].values())

    def med(key: str) -> float | None:
        vals = [x[key] for x in w if x[key] is not None]
        return statistics.median(vals) if vals else None

    c, x, r = med("compute_s"), med("exchange_s"), med("round_s")
    row: dict[str, Any] = {
        "rounds": min(v["rounds"] for v in w),
        "round_s": r,
        "compute_s": c,
        "exchange_s": x,
        "rounds_with_steps_ahead": sum(v["rounds_with_steps_ahead"] for v in w),
        "rounds_trained": sum(v["rounds_trained"] for v in w),
    }
    if c is not None and x is not None and r is not None:
        lo, hi = max(c, x), c + x
        row.update(sum_s=hi, max_s=lo, position=(r - lo) / (hi - lo) if hi > lo else None)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long each run lasts (default: 60)")
    ap.add_argument("--rate", type=float, default=20.0, help="every worker's link, Mbit/s (default: 20)")
    ap.add_argument("--throttle", type=float, default=4.0, help="the workers' --throttle (default: 4)")
    ap.add_argument("--repeats", type=int, default=1, help="off/delayed pairs (default: 1)")
    ap.add_argument("--json", type=Path, default=Path("overlap_rounds.json"))
    ap.add_argument("--keep", type=Path, help="keep logs and data dirs here (default: a temporary folder)")
    ap.add_argument("--tag", default="ov", help="the beds' NetLab tag (1-7 letters or digits; default ov)")
    a = ap.parse_args()
    try:
        check_tag(a.tag)
    except TopologyError:
        print(f"overlap_rounds: --tag {a.tag!r}: 1 to 7 lower-case letters or digits", file=sys.stderr)
        return 2
    reason = missing_prerequisite()
    if reason:
        print(f"overlap_rounds: {reason}", file=sys.stderr)
        return 1
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="overlap-rounds-") as tmp:
        base = a.keep or Path(tmp)
        for rep in range(a.repeats):
            for mode in MODES:
                got = measure(
                    "direct",
                    a.rate,
                    a.seconds,
                    base / f"{mode}-{rep}",
                    a.tag,
                    spec_text=spec_for(mode),
                    worker_args=("--throttle", str(a.throttle)),
                )
                rows.append({"overlap": mode, "repeat": rep, **summarise(got), "workers": got["workers"]})

    def f(v: float | None, spec: str = ".2f") -> str:
        return format(v, spec) if v is not None else "-"

    print(
        f"\noverlap of exchange and compute: direct path, {a.rate:g} Mbit/s links, throttle {a.throttle:g}, "
        f"{a.seconds:g} s per run\n"
    )
    print(
        f"{'overlap':8s} {'rep':>3s} {'rounds':>6s} {'round s':>8s} {'compute':>8s} {'exch':>6s} "
        f"{'sum':>6s} {'max':>6s} {'position':>8s} {'ahead':>9s}"
    )
    for r in rows:
        print(
            f"{r['overlap']:8s} {r['repeat']:3d} {r['rounds']:6d} {f(r['round_s']):>8s} {f(r['compute_s']):>8s} "
            f"{f(r['exchange_s']):>6s} {f(r.get('sum_s')):>6s} {f(r.get('max_s')):>6s} "
            f"{f(r.get('position')):>8s} {r['rounds_with_steps_ahead']:>4d}/{r['rounds_trained']:<4d}"
        )
    print("\nposition = (round - max) / (sum - max): 1 = compute and exchange in sequence, 0 = fully overlapped")
    a.json.write_text(
        json.dumps({"rate_mbit": a.rate, "throttle": a.throttle, "seconds": a.seconds, "rows": rows}, indent=2)
    )
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

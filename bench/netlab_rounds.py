"""Benchmark: round time, exchange time and bytes of a demo cell over shaped links on the
network test bed, direct and relayed, next to what the simulator's cost model predicts.

For each link rate (20 and 100 Mbit/s, both directions of every worker's link, tbf) and each
path, on a fresh bed (sim/netlab/, root only), a real `bagel-coordinator serve` on the public
segment and two real `bagel-worker join` processes with the printed join string:

- direct: a home worker (home1-1, behind its NAT) and a public one (pub1); the home worker
  dials the public one, so their connection is direct;
- relayed: a worker behind each of the two NATs (home1-1, home2-1); neither accepts an
  inbound connection, so every byte between them goes through the coordinator's libp2p
  circuit relay (the relay's own link is not shaped).

Measured, per worker, from its `--log-json` `committed` events with two contributors: the
round time (the median interval between consecutive such commits), the exchange time
(`comm_s`: the all-reduce from the first dial to the last applied part) and the exchange
bytes the worker sent. The model column is `sim/discrete/costmodel.py`: `allreduce_s` over
the two links' rates (bytes/s) and one-way latencies, `allreduce_bytes_per_member` for the
bytes, with S the encoded size of the cell's parameter vector under the run's codec; its
round is the measured compute (the `ready` events' `compute_s`) plus that exchange. The
`+shad` columns add what the model leaves out: the verified exchange also sends every part
to its shadow reducer, 3 (k - 1)/k x S per member instead of 2 (k - 1)/k x S. In the direct
placement the home worker is relayed by reachability (it is behind a NAT), so the
coordinator gives it an empty part; the per-worker bytes are in the JSON.

Latency: a link at D ms adds D ms of round trip (netem, D/2 each way, as tbf's child), so
the two shaped links of a path put 2 D between the workers. It needs `tc netem`: where the
kernel has no sch_netem (this machine's has not, so these rows have never run here) the bed
refuses a delay, and those rows print the model's prediction and "not built: no sch_netem"
instead of a measurement; nothing is faked.

    sudo .venv/bin/python bench/netlab_rounds.py [--seconds 60] [--json out.json] [--tag nr]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bagel.models.experts import param_count
from bagel.sim.discrete.costmodel import allreduce_bytes_per_member, allreduce_s, encoded_nbytes
from bagel.sim.netlab.bed import NetLab, NetLabError, missing_prerequisite
from bagel.sim.netlab.logs import events, wait_line
from bagel.sim.netlab.runs import tiny_run_spec
from bagel.sim.netlab.topology import TopologyError, check_tag

SPEC = tiny_run_spec("netlab-rounds", max_replicas=2)
CODEC = "int8"
RATES_MBIT = (20.0, 100.0)
DELAYS_MS = (0.0, 40.0, 150.0)
PATHS = {"direct": ("home1-1", "pub1"), "relayed": ("home1-1", "home2-1")}
SHAPED = {"home1-1": "home1", "home2-1": "home2", "pub1": "pub1"}  # the link each worker sits behind


def cell_numel() -> int:
    """The demo cell's parameter count (the spec's model), the vector the exchange averages."""
    return int(param_count("dit", "tiny", 8, 1, 10))


def model(rate_mbit: float, delay_ms: float) -> dict[str, float]:
    """The cost model's exchange time and bytes per member for two workers on these links."""
    nbytes = encoded_nbytes(CODEC, cell_numel())
    bw = rate_mbit * 1e6 / 8
    k = 2
    # the verified exchange also sends every part to its shadow reducer: 3 (k - 1)/k x S per
    # member instead of the butterfly's 2 (k - 1)/k x S (the cost model leaves shadows out)
    shadow_bytes = 3 * (k - 1) / k * nbytes
    return {
        "exchange_s": allreduce_s(nbytes, [bw, bw], [delay_ms / 1000, delay_ms / 1000]),
        "bytes_per_member": float(allreduce_bytes_per_member(nbytes, k)),
        "exchange_s_with_shadows": shadow_bytes / bw + 2 * delay_ms / 1000,
        "bytes_per_member_with_shadows": shadow_bytes,
        "encoded_vector_bytes": float(nbytes),
    }


def measure(
    path: str,
    rate_mbit: float,
    seconds: float,
    root: Path,
    tag: str = "nr",
    delay_ms: float = 0.0,
    *,
    spec_text: str = SPEC,
    worker_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One run on a fresh bed: coordinator, the path's two workers, links shaped to `rate_mbit`
    and, where the kernel has netem, `delay_ms` of round trip per shaped link (half each way).
    `spec_text` and `worker_args` (extra `bagel-worker join` flags) vary the run."""
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "spec.toml"
    spec.write_text(spec_text)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    py = sys.executable
    nodes = PATHS[path]
    with NetLab(tag=tag, homes=2, per_home=1, public=1) as lab:
        for n in nodes:
            lab.shape(SHAPED[n], rate_mbit=rate_mbit, delay_ms=delay_ms / 2)

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
                 "--name", node, "--reduce-timeout-s", "30", *worker_args],
                root / f"{node}.log",
            )  # fmt: skip
        # the clock starts once both have registered (their start, DHT and profile take tens of seconds)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not all(events(root / f"{n}.log", "registered") for n in nodes):
            time.sleep(0.5)
        started = time.time()
        time.sleep(seconds)
    per: dict[str, Any] = {}
    for n in nodes:
        ev = [
            e
            for e in events(root / f"{n}.log", "committed")
            if int(e.get("contributors", 0)) >= 2 and float(e["ts"]) >= started
        ]
        ts = [float(e["ts"]) for e in ev]
        gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)]
        reach = (events(root / f"{n}.log", "reachability") or [{}])[-1]
        ready = [float(e["compute_s"]) for e in events(root / f"{n}.log", "ready") if float(e["ts"]) >= started]
        trains = [e for e in events(root / f"{n}.log", "train") if float(e["ts"]) >= started]
        per[n] = {
            "rounds": len(ev),
            "round_s": statistics.median(gaps) if gaps else None,
            "exchange_s": statistics.median(float(e.get("comm_s", 0.0)) for e in ev) if ev else None,
            "bytes_sent": statistics.median(int(e.get("bytes_sent", 0)) for e in ev) if ev else None,
            "compute_s": statistics.median(ready) if ready else None,
            "rounds_with_steps_ahead": sum(1 for e in trains if int(e.get("ahead_steps", 0) or 0) > 0),
            "rounds_trained": len(trains),
            "reachability": reach.get("reachability", "?"),
            "paths": sorted({how for e in ev for how in e.get("paths", {}).values()}),
        }
    return {"path": path, "rate_mbit": rate_mbit, "delay_ms": delay_ms, "workers": per}


def _med(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long each configuration runs (default: 60)")
    ap.add_argument("--json", type=Path, default=Path("netlab_rounds.json"))
    ap.add_argument("--keep", type=Path, help="keep logs and data dirs here (default: a temporary folder)")
    ap.add_argument("--rates", type=float, nargs="+", default=list(RATES_MBIT))
    ap.add_argument("--tag", default="nr", help="the beds' NetLab tag (1-7 letters or digits; default nr)")
    a = ap.parse_args()
    try:
        check_tag(f"{a.tag}q")
    except TopologyError:
        print(f"netlab_rounds: --tag {a.tag!r}: 1 to 7 lower-case letters or digits", file=sys.stderr)
        return 2
    reason = missing_prerequisite()
    if reason:
        print(f"netlab_rounds: {reason}", file=sys.stderr)
        return 1
    with NetLab(tag=f"{a.tag}q", homes=1, per_home=1, public=0) as probe_lab:
        has_netem = probe_lab.has_netem
        try:
            probe_lab.shape("home1", delay_ms=40.0)
        except NetLabError as e:
            netem_reason = str(e)
        else:
            netem_reason = ""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="netlab-rounds-") as tmp:
        base = a.keep or Path(tmp)
        for rate in a.rates:
            for path in PATHS:
                for delay in DELAYS_MS:
                    row: dict[str, Any] = {
                        "path": path,
                        "rate_mbit": rate,
                        "delay_ms": delay,
                        "model": model(rate, delay),
                    }
                    if delay and (not has_netem or netem_reason):
                        row["measured"] = None
                        row["why_not"] = "not built: no sch_netem in this kernel (tc cannot add delay)"
                    else:
                        got = measure(path, rate, a.seconds, base / f"{path}-{rate:g}-{delay:g}", a.tag, delay)
                        w = got["workers"].values()
                        row["measured"] = {
                            "round_s": _med([x["round_s"] for x in w]),
                            "exchange_s": _med([x["exchange_s"] for x in w]),
                            "bytes_sent": _med([x["bytes_sent"] for x in w]),
                            "rounds": min(x["rounds"] for x in w),
                            "compute_s": _med([x["compute_s"] for x in w]),
                        }
                        row["workers"] = got["workers"]
                    rows.append(row)

    def f(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else "-"

    print(
        f"{'path':8s} {'Mbit/s':>6s} {'ms':>4s} {'rounds':>6s} {'round s':>8s} {'model':>6s} {'exch s':>7s} "
        f"{'model':>6s} {'+shad':>6s} {'bytes':>9s} {'model B':>9s} {'+shadow':>9s}  note"
    )
    for r in rows:
        m, meas = r["model"], r.get("measured")
        note = r.get("why_not", "")
        # the model's round: the measured compute (the `ready` events' compute_s) plus its exchange
        model_round = meas["compute_s"] + m["exchange_s"] if meas and meas.get("compute_s") is not None else None
        r["model"]["round_s"] = model_round
        if meas is not None:
            note = "; ".join(
                f"{n}: {x['reachability']} via {'/'.join(x['paths']) or '?'}" for n, x in r["workers"].items()
            )
        print(
            f"{r['path']:8s} {r['rate_mbit']:6.0f} {r['delay_ms']:4.0f} "
            f"{f(meas['rounds'] if meas else None, 'd'):>6s} {f(meas['round_s'] if meas else None, '.2f'):>8s} "
            f"{f(model_round, '.2f'):>6s} {f(meas['exchange_s'] if meas else None, '.3f'):>7s} "
            f"{m['exchange_s']:6.3f} {m['exchange_s_with_shadows']:6.3f} "
            f"{f(meas['bytes_sent'] if meas else None, '.0f'):>9s} {m['bytes_per_member']:9.0f} "
            f"{m['bytes_per_member_with_shadows']:9.0f}  {note}"
        )
    a.json.write_text(
        json.dumps(
            {
                "cell_params": cell_numel(),
                "codec": CODEC,
                "netem": has_netem,
                "netem_refusal": netem_reason,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

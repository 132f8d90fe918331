"""The loss audit on honest members of mixed speeds: how often it flags one, and an attacker.

A cell of the demo's run spec (`examples/digits-2x2.toml`) is trained in-process for
`--rounds` DiLoCo rounds by `--throttles` members (the demo's 1, 1.5, 2, 3 by default), each
with the worker's own round (`worker.roundwork.train_round`, its own AdamW kept across
rounds) and the coordinator's round plan (`coordinator.core.scheduler`: the group batch
split in proportion to speed, so the slowest member's steps are the smallest batches).
The committed state moves by the sample-weighted mean and the outer Nesterov step.

In every round each part of the exchange (the data plane's `part_bounds`) is audited as a
reducer audits it (`worker.heldout.SliceLossAudit`) under the coordinator's flag rule
(`coordinator.core.audit.loss_flagged`), for each way of measuring a slice:

  raw       the sender's slice as sent (the rule before this bench);
  weighted  the slice scaled by the sender's share of the part's sample weights, the step it
            contributes to the mean;
  per-share the weighted gain divided by that share, so senders of any weight are judged on
            one scale (what the reducers report now: `worker.reducer.Reduction._with_loss`).

A sender is charged in a round when the reducers of at least `audit.min_agreeing` (and
most) of the other parts flag it, as the coordinator's `Auditor` charges. Beside the
honest members, two attackers per round are audited the same way against the honest
members' gains: a sign flip of the fastest member's delta and IPM (-0.5 x the honest mean),
each at the weight of an average member, and the same sign flip at the slowest member's
weight (an attacker that claims a small budget).

Not a test. Prints a table per measure and writes `--json FILE`:
    .venv/bin/python bench/loss_audit_mixed_speeds.py --json bench-out/loss-audit-mixed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bagel.coordinator.core.audit import loss_flagged
from bagel.coordinator.core.scheduler import batch_shape, plausible_speeds, split_batch
from bagel.protocol.runspec import parse_spec
from bagel.robust.reduction import part_bounds
from bagel.worker import ddp
from bagel.worker.diloco import CellState, OuterConfig, outer_step
from bagel.worker.heldout import SliceLossAudit
from bagel.worker.parts import Layout
from bagel.worker.roundwork import RoundWork, train_round
from bagel.worker.trainer import InnerPlan, build_runtime

ROOT = Path(__file__).resolve().parent.parent
MEASURES = ("raw", "weighted", "per-share")
ATTACKS = ("flip", "flip-slow", "ipm")


def _spec(path: Path) -> Any:
    text = path.read_text()
    # the audit reads the committed weights, not their average: the bench keeps none
    return parse_spec(text.replace("decay = 0.9", "decay = 0.0"))


def run_cell(spec: Any, cell: str, throttles: list[float], rounds: int) -> dict[str, Any]:
    n = len(throttles)
    a = spec.audit
    speeds = plausible_speeds([1.0 / t for t in throttles], a.max_speedup, a.max_samples_per_s)
    batches = split_batch(spec.diloco.group_batch, speeds)
    plans = [InnerPlan(spec.diloco.inner_steps, *batch_shape(b, spec.diloco.max_micro_batch)) for b in batches]
    runtimes = [build_runtime(spec, cell, torch.device("cpu")) for _ in range(n)]
    state = CellState.from_model(runtimes[0].task.build_model())
    cfg = OuterConfig.from_spec(spec.diloco)
    audit = SliceLossAudit(spec, cell)
    need = max(a.min_agreeing, (n - 1) // 2 + 1)
    flags = {m: [0] * n for m in MEASURES}  # slice flags per member
    charged = {m: [0] * n for m in MEASURES}  # rounds charged per member
    attack_charged = {m: dict.fromkeys(ATTACKS, 0) for m in MEASURES}
    gains_seen: dict[str, list[list[float]]] = {m: [[] for _ in range(n)] for m in MEASURES}
    for rnd in range(1, rounds + 1):
        deltas = []
        for i in range(n):
            w = RoundWork(cell, rnd, 1, i, n, plans[i], 0)
            _, d = train_round(spec.run.id, runtimes[i], state, w, ddp.DistContext(), rnd == 1, None)
            deltas.append(d)
        layout = Layout.of(deltas[0])
        flat = [layout.flatten(d) for d in deltas]
        weights = [float(p.samples) for p in plans]
        total_w = sum(weights)
        honest_mean = torch.stack([wt * f for wt, f in zip(weights, flat, strict=True)]).sum(0) / total_w
        assigned = {f"m{i}": audit.assigned(rnd, i, n, plans[i].samples) for i in range(n)}
        fastest = max(range(n), key=lambda i: weights[i])
        avg_share = 1.0 / n
        for measure in MEASURES:
            per_part_flags: list[set[str]] = []
            for j, (lo, hi) in enumerate(part_bounds(layout.total, n)):
                if lo == hi:
                    per_part_flags.append(set())
                    continue
                shares = {f"m{i}": weights[i] / total_w for i in range(n)}
                shares |= {"flip": avg_share, "flip-slow": min(weights) / total_w, "ipm": avg_share}
                vectors = {f"m{i}": flat[i][lo:hi] for i in range(n)}
                vectors |= {"flip": -flat[fastest][lo:hi], "flip-slow": -flat[fastest][lo:hi]}
                vectors["ipm"] = -0.5 * honest_mean[lo:hi]
                scaled = measure != "raw"
                slices = {s: v * shares[s] if scaled else v for s, v in vectors.items()}
                att_assigned = dict.fromkeys(ATTACKS, assigned[f"m{fastest}"])
                got = audit.gains(state, layout.names, lo, slices, assigned | att_assigned, rnd)
                g = {s: v[0] / (shares[s] if measure == "per-share" else 1.0) for s, v in got.items()}
                honest = {f"m{i}": g[f"m{i}"] for i in range(n)}
                flagged = set()
                for i in range(n):
                    s = f"m{i}"
                    gains_seen[measure][i].append(honest[s])
                    if loss_flagged(honest[s], [v for k, v in honest.items() if k != s], a.loss_rel):
                        flags[measure][i] += 1
                        if j != i:  # a member's own part's reducer is not a voter on it
                            flagged.add(s)
                for s in ATTACKS:
                    if loss_flagged(g[s], list(honest.values()), a.loss_rel):
                        flagged.add(s)
                per_part_flags.append(flagged)
            for i in range(n):
                if sum(f"m{i}" in f for f in per_part_flags) >= need:
                    charged[measure][i] += 1
            for s in ATTACKS:
                if sum(s in f for f in per_part_flags) >= need:
                    attack_charged[measure][s] += 1
        avg = layout.unflatten(honest_mean)
        outer_step(state, avg, cfg)
        print(f"  {cell} round {rnd}/{rounds}", file=sys.stderr, flush=True)
    return {
        "cell": cell,
        "throttles": throttles,
        "batches": batches,
        "rounds": rounds,
        "need": need,
        "slice_flags": flags,
        "rounds_charged": charged,
        "attack_rounds_charged": attack_charged,
        "median_gain": {m: [statistics.median(g) for g in gains_seen[m]] for m in MEASURES},
        "negative_gain_fraction": {m: [sum(x < 0 for x in g) / len(g) for g in gains_seen[m]] for m in MEASURES},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", type=Path, default=ROOT / "examples" / "digits-2x2.toml")
    p.add_argument("--cells", default="k0.r1,k1.r0")
    p.add_argument("--throttles", default="1,1.5,2,3")
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = _spec(args.spec)
    throttles = [float(x) for x in args.throttles.split(",")]
    t0 = time.perf_counter()
    results = [run_cell(spec, c.strip(), throttles, args.rounds) for c in args.cells.split(",") if c.strip()]
    for r in results:
        print(f"\n{r['cell']}: {r['rounds']} rounds, throttles {r['throttles']}, step batches {r['batches']}, "
              f"charged when {r['need']} other reducers flag")  # fmt: skip
        print(f"{'measure':<9} {'member':>6} {'throttle':>8} {'slice flags':>11} {'rounds charged':>14} "
              f"{'median gain':>12} {'gain<0':>7}")  # fmt: skip
        for m in MEASURES:
            for i, t in enumerate(r["throttles"]):
                print(f"{m:<9} {i:>6} {t:>8g} {r['slice_flags'][m][i]:>11} {r['rounds_charged'][m][i]:>14} "
                      f"{r['median_gain'][m][i]:>12.2e} {r['negative_gain_fraction'][m][i]:>7.2f}")  # fmt: skip
            ac = r["attack_rounds_charged"][m]
            print(f"{m:<9} attackers charged in rounds: " + ", ".join(f"{k} {ac[k]}/{r['rounds']}" for k in ATTACKS))
    out = {"spec": str(args.spec), "wall_s": round(time.perf_counter() - t0, 1), "cells": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

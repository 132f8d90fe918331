"""Held-out loss per committed round of chaos runs, side by side: does an attacked run track an honest one?

`bagel-sim chaos` workers keep one local checkpoint per committed round
(`--keep-round-history`). For every chaos output directory given, this loads each cell's
checkpoint of every committed round (any worker's: every member applies the same bytes; a
file counts only if its state hash is the one the coordinator committed), evaluates the
cell's held-out loss on it with the task's own `eval_loss` (fixed noise seed, as the demo
report does; round 0 is the initial model), and prints, per cell and round, each run's
loss and its ratio to the first run's (the reference, e.g. the honest run). With
``--json FILE`` it writes ``{"runs": [...], "cells": {cell: [{"round": r, "loss": {run: x}}]}}``.

Usage::

    .venv/bin/python bench/chaos_heldout.py OUT/honest OUT/robust OUT/mean --json bench-out/chaos_heldout.json

The runs must train the same cells from the same seed (same spec apart from the rule). Not a
test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from bagel.coordinator.store import Store
from bagel.models.experts import cell_task
from bagel.protocol.runspec import RunSpec, parse_spec
from bagel.worker.localstate import LocalStateError, LocalStore


def committed(out: Path) -> tuple[RunSpec, str, dict[tuple[str, int], str]]:
    """The run's spec, its spec hash as the run stored it, and (cell, round) -> committed state
    hash, from the coordinator's store. The stored hash names the workers' local files: a run
    made before a change to the canonical rule strings (which the hash covers) is still read."""
    store = Store.open_readonly(out / "coordinator")
    try:
        stored = store.spec()
        if stored is None:
            raise SystemExit(f"{out}: the coordinator store has no run spec")
        snap = store.load(recent_commits=1 << 30)
    finally:
        store.close()
    return parse_spec(stored.spec_toml), stored.spec_hash, {(c.cell_id, c.round): c.state_hash for c in snap.commits}


def heldout_losses(out: Path) -> tuple[str, dict[str, dict[int, float]]]:
    """(rule, cell -> round -> held-out loss) of one chaos run."""
    spec, spec_hash, hashes = committed(out)
    found: dict[tuple[str, int], Any] = {}
    for wdir in sorted((out / "workers").iterdir()):
        for path in sorted((wdir / "runs" / spec.run.id / "history").glob("*.safetensors")):
            store = LocalStore(wdir, spec.run.id, spec_hash)
            store.path = path
            try:
                cp = store.load()
            except LocalStateError:
                continue
            if cp is None:
                continue
            key = (cp.cell_id, cp.committed_round)
            if key not in found and hashes.get(key) == cp.state_hash:
                found[key] = cp.state
    losses: dict[str, dict[int, float]] = {}
    for cell in spec.cell_ids:
        task = cell_task(spec, cell)
        x, y = task.heldout_data()
        model = task.build_model()
        per_round = {0: task.eval_loss(model, x, y, seed=0)}
        for (c, rnd), state in sorted(found.items()):
            if c == cell:
                state.load_into(model)
                per_round[rnd] = task.eval_loss(model, x, y, seed=0)
        losses[cell] = per_round
    return spec.diloco.aggregation, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="chaos --out directories; the first is the reference")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = [p.name for p in args.runs]
    results = {p.name: heldout_losses(p) for p in args.runs}
    ref = names[0]
    cells: dict[str, list[dict[str, Any]]] = {}
    for cell in results[ref][1]:
        rounds = sorted(set().union(*(set(results[n][1].get(cell, {})) for n in names)))
        print(f"\ncell {cell}: held-out loss per committed round (ratio to {ref})")
        print(f"{'round':>5} " + " ".join(f"{n + ' (' + results[n][0].split(':')[0] + ')':>28}" for n in names))
        rows = []
        by_round: list[tuple[int, dict[str, float | None]]] = []
        for r in rounds:
            row = {n: results[n][1].get(cell, {}).get(r) for n in names}
            base = row[ref]
            cols = []
            for n in names:
                v = row[n]
                if v is None:
                    cols.append(f"{'-':>28}")
                elif base is None or not math.isfinite(base) or base == 0:
                    cols.append(f"{v:>28.4f}")
                else:
                    cols.append(f"{v:>17.4f} ({v / base:>7.3f}x)")
            print(f"{r:>5} " + " ".join(cols))
            rows.append({"round": r, "loss": row})
            by_round.append((r, row))
        cells[cell] = rows
        for n in names[1:]:
            pairs = [(row[n], row[ref]) for r, row in by_round if r > 0]
            ratios = [a / b for a, b in pairs if a is not None and b is not None and b > 0]
            if ratios:
                within = sum(q <= 1.10 for q in ratios)
                print(
                    f"{n}: within 10% of {ref} at {within}/{len(ratios)} rounds, "
                    f"peak {max(ratios):.3f}x, final {ratios[-1]:.3f}x"
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        runs = [{"name": n, "dir": str(p), "aggregation": results[n][0]} for n, p in zip(names, args.runs, strict=True)]
        args.json.write_text(json.dumps({"runs": runs, "cells": cells}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""A single-member cell across a resume: does anything in the resume path make held-out loss jump?

Built to look for the cause of a committed round that took a one-member cell's held-out
loss from 0.326 to 3.089, 14 rounds after a resume. One expert cell of
`examples/digits-2x2.toml` (default `k1.r1`), one member, the worker's real pieces: the
inner round (`roundwork.train_round`: H AdamW steps, AdamW kept across rounds as the
worker keeps it), the int8 contribution with error feedback (`parts.prepare_contribution`,
the reducer's `reduce_part`, decode), the outer Nesterov step (`diloco.outer_step`), and
the commit guard's measurement (`heldout.HeldoutProbe`). Variants, the same data and seeds:

- `none`: no resume;
- `keep`: at round R a resume as `Orders.load_local` does it (state, momentum and
  residuals from the checkpoint, a fresh inner AdamW);
- `drop`: the same, but the error-feedback residuals are dropped (as after a resync);
- `rebuild`: a brand-new runtime at round R (model and trainer rebuilt, as a restarted process).

Prints held-out loss, |delta| and |outer momentum| per round and the largest round-over-round
held-out ratio of each variant; writes JSON. Not a test.
    .venv/bin/python bench/single_member_resume.py --rounds 36 --inner-steps 10 --resume-at 12
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bagel.compression.base import decode, get_codec
from bagel.protocol.runspec import parse_spec
from bagel.robust.aggregation import get_reducer
from bagel.worker import ddp
from bagel.worker.diloco import CellState, OuterConfig, outer_step
from bagel.worker.heldout import HeldoutProbe
from bagel.worker.parts import prepare_contribution, reduce_part
from bagel.worker.roundwork import RoundWork, fresh_feedback, train_round
from bagel.worker.trainer import InnerPlan, build_runtime


def norm(ts: Any) -> float:
    return float(sum(float(t.norm() ** 2) for t in ts) ** 0.5)


def run(spec: Any, cell: str, rounds: int, h: int, resume_at: int, variant: str) -> list[dict[str, float]]:
    rt = build_runtime(spec, cell, torch.device("cpu"))
    state = CellState.from_model(rt.task.build_model())
    probe = HeldoutProbe(spec, cell)
    codec, reducer, cfg = get_codec(spec.diloco.codec), get_reducer("mean"), OuterConfig.from_spec(spec.diloco)
    residuals: dict[str, torch.Tensor] = {}
    rows = [{"round": 0.0, "heldout": float(probe.loss(state, state.state_hash()) or 0.0)}]
    for rnd in range(1, rounds + 1):
        resume = variant != "none" and rnd == resume_at
        if resume and variant == "drop":
            residuals = {}
        if resume and variant == "rebuild":
            rt = build_runtime(spec, cell, torch.device("cpu"))
        w = RoundWork(cell, rnd, 1, 0, 1, InnerPlan(h, spec.diloco.group_batch, 1), 0)
        res, delta = train_round(spec.run.id, rt, state, w, ddp.DistContext(), rnd == 1 or resume, None)
        ef = fresh_feedback(residuals)
        c = prepare_contribution(delta, codec, 1, ("bench", rnd), weight=float(res.samples), error_feedback=ef)
        gen = torch.Generator().manual_seed(rnd)
        avg = c.layout.unflatten(decode(reduce_part(codec, reducer, [c.decoded(0)], [float(res.samples)], gen)))
        c.commit_error_feedback(ef)
        residuals = {n: r for n in delta if (r := ef.residual(n)) is not None}
        new = state.clone()
        outer_step(new, avg, cfg)
        state = new
        rows.append(
            {
                "round": float(rnd),
                "heldout": float(probe.loss(state, state.state_hash()) or 0.0),
                "delta": norm(delta.values()),
                "momentum": norm(state.momentum.values()),
                "residual": norm(residuals.values()),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="examples/digits-2x2.toml")
    p.add_argument("--cell", default="k1.r1")
    p.add_argument("--rounds", type=int, default=36)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--resume-at", type=int, default=12)
    p.add_argument("--variants", default="none,keep,drop,rebuild")
    p.add_argument("--json", default="bench-out/single_member_resume.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    spec = parse_spec(Path(args.spec).read_text())
    out: dict[str, Any] = {"cell": args.cell, "inner_steps": args.inner_steps, "resume_at": args.resume_at}
    t0 = time.time()
    for v in args.variants.split(","):
        rows = run(spec, args.cell, args.rounds, args.inner_steps, args.resume_at, v)
        jumps = [b["heldout"] / a["heldout"] for a, b in zip(rows, rows[1:], strict=False) if a["heldout"] > 0]
        out[v] = {"rows": rows, "max_ratio": max(jumps), "final": rows[-1]["heldout"]}
        print(f"{v:8s} final held-out {rows[-1]['heldout']:.4f}  largest round-over-round ratio {max(jumps):.3f}")
    r = args.resume_at
    print(f"\n round | {' | '.join(f'{v:>22s}' for v in args.variants.split(','))}   (held-out, |delta|)")
    for i in range(max(1, r - 2), min(args.rounds, r + 3) + 1):
        cells = [
            f"{out[v]['rows'][i]['heldout']:.4f}, {out[v]['rows'][i]['delta']:7.3f}" for v in args.variants.split(",")
        ]
        print(f" {i:5d} | {' | '.join(f'{c:>22s}' for c in cells)}")
    out["seconds"] = time.time() - t0
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()

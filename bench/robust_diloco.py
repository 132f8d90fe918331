"""Held-out loss under attack, in one process and without timing noise: an 8-member DiLoCo cell, rule by rule.

The same question as `bagel-sim chaos sim/scenarios/chaos-robust-8.toml` (8 workers in one
cell, one `sign-flip` and one `alie`): is the cell's held-out loss with the default rule
within 10% of an honest run at every committed round? A chaos run answers it with real
processes, and its budgets follow the throughput the coordinator measured, so two honest
runs with the same seed split the batch differently and end a few percent apart. Here
every member trains an equal share of `diloco.group_batch`, so an honest run is
bit-reproducible and the comparison measures the rule alone.

Each round uses the worker's real pieces: the inner round (`roundwork.train_round`: H
AdamW steps on member m of 8's shard, AdamW kept across rounds as the worker keeps it), the
hostile deltas (`roundwork.corrupt`, the `--byzantine` modes), the contribution with error
feedback (`parts.prepare_contribution`: the spec's codec, 8 parts), the reduction of every
part (`robust.reduction.reduce_one_part`, the one path the reducers and the coordinator's
check run, exclusions included), and the outer Nesterov step (`diloco.outer_step`). The
held-out loss is `CellTask.eval_loss` over the cell's held-out split with seed 0, the figure
`bench/chaos_heldout.py` reads from a chaos run's checkpoints.

Prints, per round, the honest run's loss and every attacked rule's ratio to it, and the
hostile parts the rules excluded; writes ``{"meta", "rounds", "runs": {name: {...}}}`` with
``--json``. Not a test.

Usage::

    .venv/bin/python bench/robust_diloco.py --rounds 25 --rules centered_clip mean --json bench-out/robust_diloco.json
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path
from typing import Any

import torch

from bagel.compression import get_codec
from bagel.protocol.runspec import RunSpec, parse_spec
from bagel.robust.aggregation import get_reducer
from bagel.robust.reduction import PartInput, decode_part, reduce_one_part, result_generator
from bagel.worker import ddp
from bagel.worker.diloco import CellState, OuterConfig, outer_step
from bagel.worker.parts import prepare_contribution
from bagel.worker.roundwork import RoundWork, corrupt, fresh_feedback, train_round
from bagel.worker.trainer import InnerPlan, build_runtime

SCENARIO = Path("sim/scenarios/chaos-robust-8.toml")
HOSTILE = {6: "sign-flip", 7: "alie"}  # as chaos-robust-8's [workers.byzantine]


def load_spec(path: Path) -> RunSpec:
    return parse_spec(tomllib.loads(path.read_text())["chaos"]["run_spec"])


def run(
    spec: RunSpec, rule: str, hostile: dict[int, str], rounds: int, members: int, on_round: Any = None
) -> dict[str, Any]:
    """One cell trained for `rounds` rounds by `members` members aggregating with `rule`."""
    cell = spec.cell_ids[0]
    codec, reducer, cfg = get_codec(spec.diloco.codec), get_reducer(rule), OuterConfig.from_spec(spec.diloco)
    rts = [build_runtime(spec, cell, torch.device("cpu")) for _ in range(members)]
    task = rts[0].task
    x, y = task.heldout_data()
    model = task.build_model()
    state = CellState.from_model(model)
    per_member = spec.diloco.group_batch // members
    plan = InnerPlan(spec.diloco.inner_steps, per_member, 1)
    residuals: list[dict[str, torch.Tensor]] = [{} for _ in range(members)]
    first: list[dict[str, torch.Tensor] | None] = [None] * members
    last: list[dict[str, torch.Tensor] | None] = [None] * members
    names = [f"w{m}" for m in range(members)]
    losses = [task.eval_loss(model, x, y, seed=0)]
    excluded: list[dict[str, str]] = []
    for rnd in range(1, rounds + 1):
        contributions = []
        for m, rt in enumerate(rts):
            w = RoundWork(cell, rnd, 1, m, members, plan, 0)
            res, honest = train_round(spec.run.id, rt, state, w, ddp.DistContext(), rnd == 1, None)
            delta = honest
            if m in hostile:
                delta = corrupt(honest, hostile[m], last[m], first[m])
                first[m] = first[m] or {k: v.clone() for k, v in honest.items()}
                last[m] = {k: v.clone() for k, v in honest.items()}
            ef = fresh_feedback(residuals[m])
            c = prepare_contribution(
                delta, codec, members, ("bench", rnd, m), weight=float(res.samples), error_feedback=ef
            )
            c.commit_error_feedback(ef)
            residuals[m] = {n: r for n in delta if (r := ef.residual(n)) is not None}
            contributions.append((c, float(res.samples)))
        layout, bounds = contributions[0][0].layout, contributions[0][0].bounds
        averaged, out = [], {}
        for p, (s, e) in enumerate(bounds):
            inputs = [
                PartInput(names[m], wgt, plan.batch * plan.inner_steps, c.payloads[p])
                for m, (c, wgt) in enumerate(contributions)
            ]
            red = reduce_one_part(codec, reducer, e - s, inputs, result_generator(spec.run.id, cell, rnd, 1, 1, p))
            averaged.append(decode_part(codec, red.payload, e - s))
            out.update({f"{sender}/p{p}": reason for sender, reason in red.excluded})
        new = state.clone()
        outer_step(new, layout.unflatten(torch.cat(averaged)), cfg)
        state = new
        state.load_into(model)
        losses.append(task.eval_loss(model, x, y, seed=0))
        excluded.append(out)
        if on_round is not None:
            on_round(rnd, losses[-1], out)
    return {
        "rule": reducer.spec(),
        "hostile": {names[m]: v for m, v in hostile.items()},
        "loss": losses,
        "excluded": excluded,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", type=Path, default=SCENARIO, help="a chaos scenario whose run_spec to train")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--rules", nargs="+", default=["centered_clip", "mean"], help="attacked runs, one per rule")
    ap.add_argument("--honest-rule", default="centered_clip", help="the honest reference's rule")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = load_spec(args.scenario)
    t0 = time.time()
    runs: dict[str, dict[str, Any]] = {}

    def progress(name: str) -> Any:
        def cb(rnd: int, loss: float, out: dict[str, str]) -> None:
            print(f"  {name:<40} round {rnd:>3} loss {loss:.4f} excluded {sorted(out)[:4]}", flush=True)

        return cb

    runs["honest"] = run(spec, args.honest_rule, {}, args.rounds, args.members, progress("honest"))
    for rule in args.rules:
        runs[rule] = run(spec, rule, HOSTILE, args.rounds, args.members, progress(rule))
    ref = runs["honest"]["loss"]
    attacked = list(args.rules)
    print(f"\nheld-out loss per round: honest ({args.honest_rule}), and attacked runs as a ratio to it")
    print(f"{'round':>5} {'honest':>8} " + " ".join(f"{r[:28]:>28}" for r in attacked))
    for i, base in enumerate(ref):
        print(f"{i:>5} {base:>8.4f} " + " ".join(f"{runs[r]['loss'][i] / base:>27.3f}x" for r in attacked))
    for r in attacked:
        ratios = [a / b for a, b in zip(runs[r]["loss"][1:], ref[1:], strict=True)]
        within = sum(q <= 1.10 for q in ratios)
        hostile_out = sum(sum(k.split("/")[0] in runs[r]["hostile"] for k in ex) for ex in runs[r]["excluded"])
        honest_out = sum(sum(k.split("/")[0] not in runs[r]["hostile"] for k in ex) for ex in runs[r]["excluded"])
        print(
            f"{r}: within 10% at {within}/{len(ratios)} rounds, peak {max(ratios):.3f}x, final {ratios[-1]:.3f}x; "
            f"parts excluded: hostile {hostile_out}, honest {honest_out}"
        )
    print(f"({time.time() - t0:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "scenario": str(args.scenario),
            "rounds": args.rounds,
            "members": args.members,
            "seconds": time.time() - t0,
        }
        args.json.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()

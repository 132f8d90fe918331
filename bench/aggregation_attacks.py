"""Relative error of each aggregation rule under known attacks, through the reducer's own path.

n = 16 honest updates (`bagel.robust.attacks.honest_group`: a common mean plus noise, norms
spread over a factor ``--spread`` each way, claimed samples 32..64 of a budget of 64) and f
hostile ones (`bagel.robust.attacks.craft`): f = 4 for ALIE (z = 1.5) and IPM (eps = 0.1,
0.5, 1, 3), f = 7 for the crude attacks (sign flip x1000, random x1000, a finite 1e30
vector, sign flip claiming 1e9 samples). For every rule and attack it reports the worst over
``--seeds`` seeds of ||agg - honest mean|| / ||honest mean||, where the honest mean is the
plain mean of the honest parts weighted by their (clamped) samples, for two paths:

- ``reducer``: `bagel.robust.reduction.reduce_one_part` on the fp32-encoded parts, the one
  reduction of a part the reducers, shadows and the coordinator's check run: decode,
  validate, clamp each weight to the sender's budget, screen norms and directions, aggregate;
- ``rule only``: `Reducer.aggregate` on every part with the claimed weights (no clamp, no screen).

Also printed: how many honest parts the screen excluded in all those runs (it must be 0), and
how many hostile parts it excluded. It prints a table and, with ``--json FILE``, writes
``{"meta": {...}, "rows": [...]}``. Not a test: tests/test_aggregation_attacks.py asserts the bound.

Usage::

    .venv/bin/python bench/aggregation_attacks.py --json bench-out/aggregation_attacks.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from bagel.compression import get_codec
from bagel.robust.aggregation import get_reducer
from bagel.robust.attacks import ATTACKS, craft, honest_group
from bagel.robust.reduction import NoValidContribution, PartInput, decode_part, reduce_one_part

RULES = (
    "centered_clip",
    "centered_clip:min_cosine=-1",
    "trimmed_mean:0.2",
    "mean",
    "mean:min_cosine=-1",
    "centered_clip:iters=30",
)
FP32 = get_codec("fp32")
BUDGET = 64.0
N_HONEST = 16


def hostile_count(attack: str) -> int:
    if attack == "none":
        return 0
    return 4 if attack == "alie" or attack.startswith("ipm:") else 7


def rel_err(agg: torch.Tensor | None, ref: torch.Tensor) -> float:
    if agg is None:
        return math.inf
    return float((agg.to(torch.float64) - ref).norm() / ref.norm())


def run_case(rule: str, attack: str, seed: int, d: int, noise: float, spread: float) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    honest, claims = honest_group(N_HONEST, d, noise=noise, spread=spread, generator=g)
    bad = craft(attack, honest, hostile_count(attack), claim=BUDGET, generator=g) if attack != "none" else []
    parts = honest + [p for p, _ in bad]
    claimed = claims + [c for _, c in bad]
    w = torch.tensor(claims, dtype=torch.float64)
    ref = (torch.stack([h.to(torch.float64) for h in honest]) * w[:, None]).sum(0) / w.sum()
    reducer = get_reducer(rule)
    pairs = enumerate(zip(parts, claimed, strict=True))
    inputs = [PartInput(f"w{i:02d}", c, int(BUDGET), FP32.encode(p)) for i, (p, c) in pairs]
    try:
        res = reduce_one_part(FP32, reducer, d, inputs, None)
    except NoValidContribution:
        result, excluded = None, list(range(len(parts)))
    else:
        result, excluded = decode_part(FP32, res.payload, d), [int(s[1:]) for s, _ in res.excluded]
    return {
        "reducer": rel_err(result, ref),
        "rule_only": rel_err(reducer.aggregate(parts, claimed), ref),
        "honest_excluded": sum(i < N_HONEST for i in excluded),
        "hostile_excluded": sum(i >= N_HONEST for i in excluded),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--noise", type=float, default=0.5, help="honest noise std / signal std per coordinate")
    ap.add_argument("--spread", type=float, default=1.25, help="honest norms vary by this factor each way")
    ap.add_argument("--rules", nargs="+", default=list(RULES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for attack in ("none", *ATTACKS):
        for rule in args.rules:
            cases = [run_case(rule, attack, s, args.dim, args.noise, args.spread) for s in range(args.seeds)]
            rows.append(
                {
                    "attack": attack,
                    "f": hostile_count(attack),
                    "rule": rule,
                    "reducer_rel_err": max(c["reducer"] for c in cases),
                    "rule_only_rel_err": max(c["rule_only"] for c in cases),
                    "honest_excluded": sum(c["honest_excluded"] for c in cases),
                    "hostile_excluded": sum(c["hostile_excluded"] for c in cases),
                    "runs": len(cases),
                }
            )
    print(
        f"n = {N_HONEST} honest, dim {args.dim}, noise {args.noise}, spread {args.spread}, worst of {args.seeds} seeds"
    )
    print(
        f"{'attack':<16} {'f':>2} {'rule':<28} {'reducer':>10} {'rule only':>10} {'honest out':>10} {'hostile out':>11}"
    )
    for r in rows:
        print(
            f"{r['attack']:<16} {r['f']:>2} {r['rule']:<28} {r['reducer_rel_err']:>10.4g} "
            f"{r['rule_only_rel_err']:>10.4g} {r['honest_excluded']:>10} "
            f"{r['hostile_excluded']:>5}/{r['f'] * r['runs']}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"n_honest": N_HONEST, "dim": args.dim, "noise": args.noise, "spread": args.spread, "seeds": args.seeds}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

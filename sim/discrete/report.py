"""Turn engine results into `summary.json`, `summary.md` and PNG plots.

`summarize` is a pure function of the results (the CLI adds `wall_s`); the plotting
functions write files with matplotlib's Agg backend (no display needed).

summary.json is `{"policies": {NAME: {...}}, "wall_s": s, "workers": w,
"virtual_hours": h, ...}`; every policy entry has at least `goodput`, `utilization` and
`committed_rounds` (definitions in `metrics.py`), plus wasted work by cause, time to the
target samples per cell, bytes per worker and Jain's fairness across cells.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bagel.protocol.goodput import BUCKET_DEFINITIONS, BUCKETS, TRAINING, WASTE
from bagel.sim.discrete.engine import EngineResult
from bagel.sim.discrete.ledger import jain


def _time_to_target(r: EngineResult, target_samples: float) -> dict[str, Any]:
    if target_samples <= 0:
        return {
            "target_samples_per_cell": 0,
            "cells": len(r.cells),
            "cells_reached": 0,
            "median_h": None,
            "max_h": None,
        }
    expert = next(c for c in r.cells if c != "router")
    ref_share = r.cell_targets[expert]
    ref_flops = r.cell_flops_per_sample[expert]
    # a cell's target in FLOPs, scaled by its compute share (the router's is small)
    target = {c: target_samples * ref_flops * r.cell_targets[c] / ref_share for c in r.cells}
    acc = dict.fromkeys(r.cells, 0.0)
    reached: dict[str, float] = {}
    for t_s, cell, samples in r.ledger.commits:
        if cell in reached:
            continue
        acc[cell] += samples * r.cell_flops_per_sample[cell]
        if acc[cell] >= target[cell]:
            reached[cell] = t_s / 3600.0
    times = sorted(reached.values())
    # unreached cells count as never: the median exists once more than half got there
    full = times + [float("inf")] * (len(r.cells) - len(times))
    med = float(np.median(full)) if full else float("inf")
    return {
        "target_samples_per_cell": target_samples,
        "cells": len(r.cells),
        "cells_reached": len(times),
        "median_h": med if np.isfinite(med) else None,
        "max_h": float(max(times)) if len(times) == len(r.cells) else None,
        "first_h": float(times[0]) if times else None,
    }


CATCH_UP_OUTCOMES = ("tried", "caught up", "no donor held them", "rounds")


def policy_summary(r: EngineResult, target_samples: float) -> dict[str, Any]:
    L = r.ledger
    off = L.offered
    frac = {k: (v / off if off > 0 else 0.0) for k, v in L.buckets.items()}
    per_cell_flops = dict.fromkeys(r.cells, 0.0)
    for _t, cell, samples in L.commits:
        per_cell_flops[cell] += samples * r.cell_flops_per_sample[cell]
    x = np.array([per_cell_flops[c] / r.cell_targets[c] for c in r.cells if r.cell_targets[c] > 0])
    rounds = r.rounds_timeline[-1] if len(r.rounds_timeline) else np.zeros(len(r.cells))
    seen = r.ever_online
    online_worker_h = float(np.trapezoid(r.online_timeline, r.timeline_h)) if len(r.timeline_h) > 1 else 0.0
    sent = r.bytes_sent[seen] if seen.any() else np.zeros(1)
    return {
        "goodput": frac["committed"],
        "utilization": sum(frac[k] for k in TRAINING),
        "committed_rounds": int(L.committed_rounds),
        "aborted_rounds": int(L.aborts),
        "committed_samples": int(sum(s for _t, _c, s in L.commits)),
        "wasted": {k: frac[k] for k in WASTE},
        "unresolved": frac["unresolved"],
        "offered_pflop": off / 1e15,
        "rounds_per_cell": {
            "min": int(rounds.min()) if len(rounds) else 0,
            "median": float(np.median(rounds)) if len(rounds) else 0.0,
            "max": int(rounds.max()) if len(rounds) else 0,
        },
        "time_to_target": _time_to_target(r, target_samples),
        "fairness_jain": jain(x),
        "bytes_sent_per_worker_mean": float(sent.mean()),
        "bytes_sent_per_worker_p95": float(np.percentile(sent, 95)),
        "bytes_per_online_worker_hour": float(r.bytes_sent.sum() / online_worker_h) if online_worker_h > 0 else 0.0,
        "steps_per_round": r.steps_per_round,
        "events": r.events,
        "core_calls": r.core_calls,
        "core_queries": r.core_queries,
        "core_errors": dict(sorted(L.core_errors.items())),
        "abort_reasons": dict(sorted(L.abort_reasons.items(), key=lambda kv: -kv[1])),
        "faults": [{"at_s": t, "kind": k, "workers": n} for t, k, n in L.faults],
        "overlap": r.overlap,
        # training ahead during the exchange (overlap = "delayed"): FLOPs as fractions of
        # offered (already in the buckets above), rounds, and why steps were thrown away
        "ahead": {
            "trained": L.ahead_trained / off if off > 0 else 0.0,
            "carried": L.ahead_carried / off if off > 0 else 0.0,
            "rounds": int(L.ahead_rounds),
            "carried_rounds": int(L.ahead_kept),
            "dropped": {
                why: {"exchanges": int(n), "flops": fl / off if off > 0 else 0.0}
                for why, (n, fl) in sorted(L.ahead_dropped.items(), key=lambda kv: -kv[1][1])
            },
        },
        # syncs that tried to catch up by committed updates ([sync] catch_up_rounds), and how
        # they ended (the failed ones then downloaded the whole state)
        "catch_up": {k: int(L.catch_up.get(k, 0)) for k in CATCH_UP_OUTCOMES},
    }


def summarize(results: Sequence[EngineResult], *, target_samples: float) -> dict[str, Any]:
    """summary.json without `wall_s` (which the CLI adds): deterministic for a seed.
    Top-level keys are exactly policies, workers, virtual_hours (+ wall_s)."""
    first = results[0]
    return {
        "policies": {r.policy: policy_summary(r, target_samples) for r in results},
        "workers": first.workers,
        "virtual_hours": first.hours,
    }


def run_meta(results: Sequence[EngineResult], *, scenario: str, seed: int, lease_mode: str) -> dict[str, Any]:
    """run.json: what was simulated, next to summary.json."""
    first = results[0]
    return {
        "scenario": scenario,
        "seed": seed,
        "lease_mode": lease_mode,
        "cells": len(first.cells),
        "throughput_spread_p95_p5": first.throughput_spread,
        "steps_per_round": {r.policy: r.steps_per_round for r in results},
    }


def write_json(summary: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")


def _fmt_h(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f} h"


def _fmt_bytes(x: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(x) < 1000:
            return f"{x:.1f} {unit}"
        x /= 1000
    return f"{x:.1f} PB"


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    pols = summary["policies"]
    lines = [
        f"# bagel-sim: {meta['scenario']}",
        "",
        f"{summary['workers']} workers, {summary['virtual_hours']:g} virtual hours, {meta['cells']} cells, "
        f"seed {meta['seed']}"
        + (f", {summary['wall_s']:.1f} s wall" if "wall_s" in summary else "")
        + f"; achieved-throughput spread (p95/p5) {meta['throughput_spread_p95_p5']:.1f}x; "
        f"leases: {meta['lease_mode']}; overlap of the exchange with compute: "
        + ", ".join(f"{name} {p['overlap']}" for name, p in pols.items())
        + ".",
        "",
        "| policy | goodput | utilisation | committed rounds | aborted | rounds/cell (min–max) | cells at target "
        "| time to target (median) | fairness (Jain) | bytes sent / worker |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, p in pols.items():
        tt = p["time_to_target"]
        rc = p["rounds_per_cell"]
        lines.append(
            f"| {name} | {p['goodput']:.3f} | {p['utilization']:.3f} | {p['committed_rounds']} | {p['aborted_rounds']} "
            f"| {rc['min']}–{rc['max']} | {tt['cells_reached']}/{tt['cells']} | {_fmt_h(tt['median_h'])} "
            f"| {p['fairness_jain']:.3f} | {_fmt_bytes(p['bytes_sent_per_worker_mean'])} |"
        )
    lines += ["", "Where the offered compute went (fractions of offered FLOPs):", ""]
    cols = ["committed"] + list(WASTE) + ["unresolved"]
    lines.append("| policy | " + " | ".join(cols) + " |")
    lines.append("| --- |" + " ---: |" * len(cols))
    for name, p in pols.items():
        vals = [p["goodput"]] + [p["wasted"][k] for k in WASTE] + [p["unresolved"]]
        lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    ahead = [(name, p["ahead"]) for name, p in pols.items() if p["overlap"] != "off"]
    if ahead:
        lines += ["", 'Trained ahead during the exchange (`[diloco] overlap = "delayed"`; in the buckets above):', ""]
        for name, a in ahead:
            why = ", ".join(f"{k} {v['flops']:.3f} ({v['exchanges']})" for k, v in a["dropped"].items()) or "none"
            lines.append(
                f"- {name}: {a['trained']:.3f} of offered trained ahead, {a['carried']:.3f} carried into the next "
                f"round ({a['carried_rounds']} of {a['rounds']} exchanges); thrown away (of offered, exchanges): {why}"
            )
    caught = [(name, p["catch_up"]) for name, p in pols.items() if p.get("catch_up", {}).get("tried")]
    if caught:
        lines += ["", "Syncs that caught up by committed updates (`[sync] catch_up_rounds`):", ""]
        for name, c in caught:
            lines.append(
                f"- {name}: {c['caught up']} of {c['tried']} caught up ({c['rounds']} rounds applied); "
                f"{c['no donor held them']} found no donor holding the updates and downloaded the state"
            )
    lines += [
        "",
        "goodput = training FLOPs in committed rounds by agreeing contributors / offered FLOPs "
        "(online time x achieved FLOP/s); utilisation = all training / offered. "
        "Rounds are not comparable across policies (a sync_dp round is a block of lock-step steps, a "
        "DiLoCo round H inner steps): compare committed compute.",
        "",
        "The buckets (every offered FLOP lands in exactly one; `bagel.sim.discrete.ledger`):",
        "",
        "| bucket | what it holds |",
        "| --- | --- |",
        *(f"| {b} | {BUCKET_DEFINITIONS[b]} |" for b in BUCKETS),
        "",
        "## Plots",
        "",
        *(f"- [{name}]({name}): {what}" for name, what in PLOTS.items()),
        "",
        *(f"![{what}]({name})" for name, what in PLOTS.items()),
        "",
    ]
    return "\n".join(lines)


PLOTS = {
    "committed_compute_per_cell.png": "committed training compute per expert cell over time, one panel per policy "
    "(shared axes)",
    "committed_compute.png": "committed training compute of the whole run over time, all policies on one axis",
    "wasted_work.png": "where the offered compute went, by bucket (definitions below)",
    "utilization.png": "utilisation (all training / online compute) over time, and the online workers",
}
_COMMITTED_COMPUTE = "committed compute = FLOPs of the samples in committed rounds (agreeing contributors)"


def _cell_compute(r: EngineResult, cells: list[str]) -> np.ndarray:
    """Cumulative committed PFLOP per cell (columns) at each timeline point (rows)."""
    col = {c: j for j, c in enumerate(cells)}
    t_h = np.asarray(r.timeline_h, dtype=float)
    out = np.zeros((len(t_h), len(cells)))
    commits = [
        (t / 3600.0, col[c], smp * r.cell_flops_per_sample[c] / 1e15) for t, c, smp in r.ledger.commits if c in col
    ]
    for t, j, pflop in commits:
        out[np.searchsorted(t_h, t, side="left") :, j] += pflop
    return out


def plot(results: Sequence[EngineResult], out: Path) -> list[Path]:
    """The four plots of `PLOTS`, each with a title and its terms defined on the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    n = len(results)
    # committed compute per expert cell: the same units for every policy (a sync_dp "round"
    # and a DiLoCo round of H inner steps are not comparable, their compute is), so the
    # panels share both axes
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4.4), squeeze=False, sharex=True, sharey=True)
    for ax, r in zip(axes[0], results, strict=True):
        experts = [c for c in r.cells if c != "router"]
        if experts and len(r.timeline_h):
            ex = _cell_compute(r, experts)
            for j in range(ex.shape[1]):
                ax.plot(r.timeline_h, ex[:, j], lw=0.5, alpha=0.25, color="tab:blue")
            ax.fill_between(
                r.timeline_h,
                np.percentile(ex, 10, axis=1),
                np.percentile(ex, 90, axis=1),
                color="tab:blue",
                alpha=0.2,
                label="expert cells p10-p90",
            )
            ax.plot(r.timeline_h, np.median(ex, axis=1), lw=2.0, color="black", label="expert cells median")
        ax.set_title(f"{r.policy} (H = {r.steps_per_round} steps per round)")
        ax.set_xlabel("virtual hours")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8)
    axes[0][0].set_ylabel("committed compute per expert cell (PFLOP)")
    fig.suptitle("Committed compute per expert cell (shared axes)")
    fig.text(0.5, 0.01, _COMMITTED_COMPUTE + "; thin lines: single cells", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    paths.append(_save(fig, out / "committed_compute_per_cell.png"))

    # the whole run's committed compute over time, comparable across policies
    fig, ax = plt.subplots(figsize=(8, 4.4))
    for r in results:
        ts = [0.0] + [t / 3600.0 for t, _c, _s in r.ledger.commits]
        acc = np.cumsum([0.0] + [smp * r.cell_flops_per_sample[c] for _t, c, smp in r.ledger.commits]) / 1e21
        ax.step(ts, acc, where="post", label=r.policy)
    ax.set_title("Committed compute over time, all cells")
    ax.set_xlabel("virtual hours")
    ax.set_ylabel("committed training compute (ZFLOP)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    fig.text(0.5, 0.01, _COMMITTED_COMPUTE, ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    paths.append(_save(fig, out / "committed_compute.png"))

    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.6 * n))
    left = np.zeros(n)
    names = [r.policy for r in results]
    colors = plt.get_cmap("tab10")
    for k, b in enumerate(BUCKETS):
        vals = np.array([r.ledger.buckets[b] / r.ledger.offered if r.ledger.offered else 0.0 for r in results])
        ax.barh(names, vals, left=left, label=f"{b}: {BUCKET_DEFINITIONS[b]}", color=colors(k))
        left += vals
    ax.set_xlim(0, 1)
    ax.set_title("Where the offered compute went")
    ax.set_xlabel("fraction of offered compute (online time x achieved FLOP/s)")
    # below the bars, one bucket a line with its definition: the legend is the glossary
    legend = ax.legend(ncol=1, fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.25 - 0.05 * n), frameon=False)
    paths.append(_save(fig, out / "wasted_work.png", extra=(legend,)))

    fig, ax = plt.subplots(figsize=(8, 4.4))
    for r in results:
        ax.plot(r.timeline_h, r.util_timeline, label=r.policy)
    ax2 = ax.twinx()
    online = np.asarray(results[0].online_timeline, dtype=float)
    ax2.plot(results[0].timeline_h, online, color="grey", ls=":", label="online workers (right axis)")
    # from zero, like the utilisation axis: a few percent of churn must look like a few percent
    ax2.set_ylim(0, max(1.0, float(online.max()) * 1.1) if online.size else 1.0)
    ax2.set_ylabel("online workers")
    ax.set_ylim(0, 1)
    ax.set_title("Utilisation over time")
    ax.set_xlabel("virtual hours")
    ax.set_ylabel("utilisation (training / online compute)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    legend = ax.legend(
        lines[0] + lines2[0],
        lines[1] + lines2[1],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.15),
        ncol=4,
        fontsize=8,
    )  # below the axes: never over the curves
    fig.text(0.5, -0.06, "utilisation = all training, wasted or not / offered compute", ha="center", fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out / "utilization.png", extra=(legend,)))
    return paths


def _save(fig: Any, path: Path, extra: tuple[Any, ...] = ()) -> Path:
    """Save with a tight box that holds the axes, the legends outside them and the
    figure's captions (matplotlib leaves the last two out unless named)."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight", bbox_extra_artists=(*extra, *fig.texts))
    plt.close(fig)
    return path

"""The chaos run's report: summary.json, summary.md and timeline.png in the output directory.

`summary.json` is `{"invariants": {NAME: bool}, "faults": [...], "committed_rounds": n, ...}`
plus the evidence behind each verdict: violations and notes per invariant, the
commit-log reads, per-worker verdicts and events, and the Byzantine workers' effect. The
effect is measured, not asserted (the run's `diloco.aggregation`, named in the summary,
decides how much of a hostile update gets through; the default, CenteredClip, bounds it):
for every committed round we know from the coordinator's commit record who contributed and
the mean training loss the agreeing contributors reported; the report compares how the
cell's loss moved after rounds a Byzantine worker contributed to with rounds it did not.
This is training loss; bench/chaos_heldout.py evaluates the held-out loss of every
committed round from the workers' per-round checkpoints.

The timeline plots committed rounds per cell over time with the faults marked (a line at
each hit, a band while it lasted), and below it the loss: committed rounds per cell and
each worker's per-round training loss, Byzantine workers in red.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bagel.sim.chaos import invariants as inv

if TYPE_CHECKING:  # pragma: no cover
    from bagel.sim.chaos.driver import ChaosRun

_FAULT_COLORS = {
    "kill": "tab:red",
    "leave": "tab:orange",
    "stop": "tab:purple",
    "coordinator-kill": "black",
    "latency": "tab:blue",
    "bandwidth": "tab:cyan",
    "reset": "tab:brown",
    "hang": "tab:pink",
    "partition": "tab:olive",
    "loss": "tab:gray",
}


def _finite(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def byzantine_effect(run: ChaosRun) -> dict[str, Any]:
    """Per Byzantine worker: rounds contributed, verdicts, and the loss change that followed."""
    records = run.commit_records
    by_cell: dict[str, list[Any]] = defaultdict(list)
    for c in records:
        by_cell[c.cell_id].append(c)
    out: dict[str, Any] = {}
    for slot in run.workers:
        if not slot.byzantine:
            continue
        with_it: list[float] = []
        without: list[float] = []
        contributed = 0
        for commits in by_cell.values():
            commits = sorted(commits, key=lambda c: c.round)
            for a, b in zip(commits, commits[1:], strict=False):
                if b.round != a.round + 1 or not (_finite(a.loss) and _finite(b.loss)):
                    continue
                delta = b.loss - a.loss  # the loss of the round after: did this round's step help?
                (with_it if slot.worker_id in a.contributors else without).append(delta)
            contributed += sum(slot.worker_id in c.contributors for c in commits)
        out[slot.label] = {
            "worker_id": slot.worker_id,
            "mode": slot.byzantine,
            "rounds_contributed": contributed,
            "verdicts": dict(run.obs.verdicts.get(slot.index, {})),
            "mean_loss_change_after_its_rounds": round(sum(with_it) / len(with_it), 6) if with_it else None,
            "mean_loss_change_after_other_rounds": round(sum(without) / len(without), 6) if without else None,
            "rounds_compared": [len(with_it), len(without)],
        }
    return out


def findings(run: ChaosRun, final: inv.CommitLogRead) -> list[str]:
    """What a reader should look at even when every invariant holds: honest workers the
    coordinator banned, workers that logged internal errors, cells that stopped committing."""
    out: list[str] = []
    for proc in run.sup.procs:
        if proc.term_timed_out and proc.name.startswith("coordinator"):
            out.append(f"{proc.name} did not exit within its grace period after SIGTERM (it was SIGKILLed)")
    for w in run.workers:
        if w.index in run.obs.banned and not w.byzantine:
            out.append(f"honest worker {w.label} was banned: {run.obs.banned[w.index][:200]}")
        if w.index in run.obs.banned and w.byzantine:
            out.append(f"Byzantine worker {w.label} ({w.byzantine}) was banned: {run.obs.banned[w.index][:200]}")
        for proc in run.sup.procs:
            if proc.term_timed_out and proc.name.startswith(f"{w.label}-"):
                out.append(f"{proc.name} did not exit within its grace period after SIGTERM (it was SIGKILLed)")
        n = run.obs.events.get(w.index, Counter()).get("error", 0)
        if n:
            out.append(f"{w.label} logged {n} error event(s), e.g. {run.obs.errors[w.index][0][:200]!r}")
    last_end = max([ff.ended_s or ff.fired_s or 0.0 for ff in run.fired], default=0.0)
    cells = {c.cell_id for c in final.commits}
    after = {c.cell_id for c in final.commits if c.committed_s > last_end}
    for cell in sorted(cells - after):
        last = max(c.committed_s for c in final.commits if c.cell_id == cell)
        out.append(
            f"cell {cell} committed nothing after the last fault ended (its last commit at "
            f"{last - (run.t_zero or 0.0):.1f}s, the run ended at {run.end_s - (run.t_zero or 0.0):.1f}s)"
        )
    return out


def loss_by_cell(run: ChaosRun) -> dict[str, dict[str, Any]]:
    """Per cell: committed rounds, how many had a Byzantine contributor, and the committed
    loss first / best / worst / last, so a poisoned cell stands next to a clean one."""
    byz = {w.worker_id for w in run.workers if w.byzantine and w.worker_id}
    by_cell: dict[str, list[Any]] = defaultdict(list)
    for c in run.commit_records:
        by_cell[c.cell_id].append(c)
    out: dict[str, dict[str, Any]] = {}
    for cell, commits in sorted(by_cell.items()):
        commits.sort(key=lambda c: c.round)
        losses = [c.loss for c in commits if _finite(c.loss) is not None]
        out[cell] = {
            "rounds": len(commits),
            "rounds_with_byzantine_contributor": sum(bool(byz & set(c.contributors)) for c in commits),
            "first_loss": round(losses[0], 4) if losses else None,
            "best_loss": round(min(losses), 4) if losses else None,
            "worst_loss": round(max(losses), 4) if losses else None,
            "last_loss": round(losses[-1], 4) if losses else None,
        }
    return out


def build_summary(run: ChaosRun, h: inv.History, results: dict[str, inv.InvariantResult]) -> dict[str, Any]:
    """Write summary.json, summary.md and timeline.png into run.out; return the summary."""
    final = max(run.commit_logs, key=lambda r: r.t_s) if run.commit_logs else inv.CommitLogRead(0.0, "none", ())
    per_cell: dict[str, int] = defaultdict(int)
    for c in final.commits:
        per_cell[c.cell_id] += 1
    records = run.commit_records
    contributed: dict[str, int] = defaultdict(int)
    loss: dict[str, list[list[float | None]]] = defaultdict(list)
    t0 = run.t_zero or 0.0
    for c in records:
        for w in c.contributors:
            contributed[w] += 1
        loss[c.cell_id].append([round(c.committed_ms / 1000.0 - run.origin - t0, 3), c.round, _finite(c.loss)])
    summary: dict[str, Any] = {
        "scenario": run.sc.name,
        "aggregation": run.sc.spec.diloco.aggregation,
        "invariants": {name: r.ok for name, r in results.items()},
        "violations": {name: list(r.violations) for name, r in results.items() if r.violations},
        "notes": {name: list(r.notes) for name, r in results.items() if r.notes},
        "faults": [ff.as_dict(run.t_zero) for ff in run.fired],
        "committed_rounds": len(final.commits),
        "committed_rounds_per_cell": dict(sorted(per_cell.items())),
        "progress_bound_s": run.sc.progress_bound_s,
        "t_zero_run_s": None if run.t_zero is None else round(run.t_zero, 3),
        "end_run_s": round(run.end_s, 3),
        "stop_reason": run.stop_reason,
        "findings": findings(run, final),
        "interrupted": run.stop_reason == "interrupted",
        "workers": [
            {
                "index": w.index,
                "worker_id": w.worker_id,
                "byzantine": w.byzantine or None,
                "throttle": w.throttle,
                "starts": w.starts,
                "rounds_contributed": contributed.get(w.worker_id, 0),
                "verdicts": dict(run.obs.verdicts.get(w.index, {})),
                "events": dict(run.obs.events.get(w.index, {})),
                "unexpected_exits": w.unexpected_exits,
                "banned": run.obs.banned.get(w.index),
                "errors": list(run.obs.errors.get(w.index, [])),
            }
            for w in run.workers
        ],
        "coordinator_starts": run.coordinator_starts,
        "byzantine": byzantine_effect(run),
        "cells": loss_by_cell(run),
        "loss_per_cell": dict(sorted(loss.items())),
        "commit_log_reads": [
            {"label": r.label, "run_time_s": round(r.t_s, 3), "commits": len(r.commits)} for r in run.commit_logs
        ],
        "evidence": {
            "acknowledged_commits": len(h.acknowledged),
            "hash_observations": len(h.hashes),
            "local_checkpoints_rehashed": run.n_local_checkpoints,
            "started_pids": len(h.started_pids),
            "bound_ports": list(h.bound_ports),
        },
        "bed": None if run.bed is None else {**run.bed.as_dict(), "join_strings": run.join_strings},
        "proxy": None
        if run.proxy is None
        else {
            "address": run.proxy.address,
            "connections": run.proxy.stats.connections,
            "resets": run.proxy.stats.resets,
            "bytes_up": run.proxy.stats.bytes_up,
            "bytes_down": run.proxy.stats.bytes_down,
        },
    }
    out = Path(run.out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    try:
        plot_timeline(run, final, out / "timeline.png")
        summary["timeline"] = "timeline.png"
    except Exception as e:  # a plotting failure must not hide the verdicts
        summary["timeline_error"] = f"{type(e).__name__}: {e}"
        (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    (out / "summary.md").write_text(markdown(summary, results))
    return summary


def plot_timeline(run: ChaosRun, final: inv.CommitLogRead, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = run.t_zero or 0.0
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    cells: dict[str, list[float]] = defaultdict(list)
    for c in final.commits:
        cells[c.cell_id].append(c.committed_s - t0)
    for cell, ts in sorted(cells.items()):
        ts.sort()
        ax.step([ts[0]] + ts, [0] + list(range(1, len(ts) + 1)), where="post", label=f"cell {cell}")
    seen: set[str] = set()
    for ff in run.fired:
        if ff.fired_s is None:
            continue
        kind = ff.fault.kind.value
        color = _FAULT_COLORS.get(kind, "gray")
        start = ff.fired_s - t0
        end = (ff.ended_s if ff.ended_s is not None else ff.fired_s) - t0
        for axis in (ax, bx):
            axis.axvline(start, color=color, linestyle="--", linewidth=1.2, label=None)
            if end > start:
                axis.axvspan(start, end, color=color, alpha=0.12)
        ax.annotate(
            kind,
            (start, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color=color,
        )
        if kind not in seen:
            seen.add(kind)
            ax.plot([], [], color=color, linestyle="--", label=f"fault: {kind}")
    ax.set_ylabel("committed rounds")
    ax.set_title(f"bagel-sim chaos: {run.sc.name} ({len(final.commits)} committed rounds)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    records = run.commit_records
    by_cell: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for c in records:
        if _finite(c.loss) is not None:
            by_cell[c.cell_id].append((c.committed_ms / 1000.0 - run.origin - t0, c.loss))
    for cell, pts in sorted(by_cell.items()):
        pts.sort()
        bx.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=f"cell {cell} (committed)")
    byz = {w.index for w in run.workers if w.byzantine}
    for idx in sorted({r[1] for r in run.obs.ready_loss}):
        pts = [(t - t0, loss) for t, w, _c, _r, loss in run.obs.ready_loss if w == idx and math.isfinite(loss)]
        if not pts:
            continue
        style = (
            {"color": "red", "marker": "x", "s": 18}
            if idx in byz
            else {"color": "gray", "marker": ".", "s": 8, "alpha": 0.6}
        )
        label = f"w{idx} {run.workers[idx].byzantine} (Byzantine)" if idx in byz else None
        bx.scatter([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
    lo, hi = bx.get_ylim()
    if lo > 0 and hi / lo > 20:  # a diverging (Byzantine) cell would flatten the others
        bx.set_yscale("log")
    bx.set_ylabel("training loss")
    bx.set_xlabel("seconds since the first committed round")
    if bx.get_legend_handles_labels()[0]:
        bx.legend(loc="upper right", fontsize=8)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(summary: dict[str, Any], results: dict[str, inv.InvariantResult]) -> str:
    ok = all(summary["invariants"].values())
    lines = [
        f"# bagel-sim chaos: {summary['scenario']}",
        "",
        f"**{'PASS' if ok else 'FAIL'}** — {summary['committed_rounds']} committed rounds; "
        f"stopped: {summary['stop_reason']}.",
        "",
        "## Invariants",
        "",
        "| invariant | holds | evidence |",
        "| --- | --- | --- |",
    ]
    for name, r in results.items():
        ev = "; ".join(r.violations[:3]) + (f" (+{len(r.violations) - 3} more)" if len(r.violations) > 3 else "")
        lines.append(f"| `{name}` | {'yes' if r.ok else '**NO**'} | {ev.replace('|', '/') or '-'} |")
    lines += ["", f"Progress bound: {summary['progress_bound_s']:g} s after each fault ends."]
    if summary.get("findings"):
        lines += ["", "## Findings (not invariants, worth a look)", ""] + [f"- {f}" for f in summary["findings"]]
    lines += [
        "",
        "## Faults",
        "",
        "| # | kind | at (s) | ended (s) | targets | detail |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in summary["faults"]:
        at = "not fired" if f["at_s"] is None else f"{f['at_s']:.1f}"
        end = "-" if f["end_s"] is None else f"{f['end_s']:.1f}"
        detail = f["detail"] + (f" ERROR: {f['error']}" if f["error"] else "")
        lines.append(f"| {f['index']} | {f['kind']} | {at} | {end} | {', '.join(f['targets'])} | {detail} |")
    lines += [
        "",
        "## Committed rounds per cell",
        "",
        "| cell | rounds | with a Byzantine contributor | loss first | best | worst | last |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    cells = summary.get("cells", {})
    for c, n in summary["committed_rounds_per_cell"].items():
        x = cells.get(c, {})
        lines.append(
            f"| {c} | {n} | {x.get('rounds_with_byzantine_contributor', '-')} | {x.get('first_loss')} | "
            f"{x.get('best_loss')} | {x.get('worst_loss')} | {x.get('last_loss')} |"
        )
    lines += [
        "",
        "## Workers",
        "",
        "| worker | id | Byzantine | starts | rounds contributed | verdicts | banned | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in summary["workers"]:
        verdicts = ", ".join(f"{k} {v}" for k, v in sorted(w["verdicts"].items()))
        banned = "yes" if w.get("banned") else "-"
        errors = w["events"].get("error", 0)
        lines.append(
            f"| w{w['index']} | {w['worker_id']} | {w['byzantine'] or '-'} | {w['starts']} | "
            f"{w['rounds_contributed']} | {verdicts} | {banned} | {errors} |"
        )
    if summary["byzantine"]:
        lines += [
            "",
            "## Byzantine workers",
            "",
            f"The run aggregates with {summary.get('aggregation', '?')!r} (diloco.aggregation): with the plain "
            "mean a Byzantine worker's update is averaged in, with a robust rule it is bounded; compare its "
            "cell's loss with the clean cells above (bench/chaos_heldout.py compares the held-out loss of two "
            "runs round by round). Loss change = the cell's "
            "committed loss in the next round minus this round's, averaged over the rounds it contributed "
            "to / all other rounds.",
            "",
            "| worker | mode | rounds contributed | loss change after its rounds | after the others | verdicts |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for label, b in summary["byzantine"].items():
            verdicts = ", ".join(f"{k} {v}" for k, v in sorted(b["verdicts"].items()))
            lines.append(
                f"| {label} | {b['mode']} | {b['rounds_contributed']} | {b['mean_loss_change_after_its_rounds']} | "
                f"{b['mean_loss_change_after_other_rounds']} | {verdicts} |"
            )
        for n in summary["notes"].get("replicas_bit_identical", []):
            lines.append(f"- hash disagreement (exempt, Byzantine): {n}")
    if summary.get("bed"):
        lines += _bed_markdown(summary["bed"])
    lines += ["", "## Commit-log reads", ""]
    lines += [f"- {r['label']} at {r['run_time_s']:.1f} s: {r['commits']} commits" for r in summary["commit_log_reads"]]
    lines += ["", "![timeline](timeline.png)", ""]
    return "\n".join(lines)


def _bed_markdown(bed: dict[str, Any]) -> list[str]:
    """The network test bed: where each worker ran, and each link fault as read back from the kernel."""

    def state(x: dict[str, Any] | None) -> str:
        if x is None:
            return "-"
        part = "cut" if x["partitioned"] else "open"
        sides = []
        for d in ("up", "down"):
            rate, loss = x[d]["rate_mbit"], x[d]["loss_pct"]
            sides.append(f"{d} {'-' if rate is None else f'{rate:g} Mbit/s'}, {loss:g} %")
        return f"{part}; " + "; ".join(sides)

    joins = bed.get("join_strings", [])
    lines = [
        "",
        "## Network test bed",
        "",
        f"Tag `{bed['tag']}`, coordinator on {bed['coordinator']}; "
        + ", ".join(f"{w} on {n}" for w, n in bed["placement"].items())
        + f". Torn down: {'yes' if bed['torn_down'] else '**no**'}, namespaces left: {bed['namespaces_left']}. "
        + f"Join string identical across {len(joins)} coordinator start(s): "
        + f"{'yes' if len(set(joins)) <= 1 else '**no**'}.",
        "",
        "| # | kind | link | asked | read back when applied | read back when undone | undone by |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in bed["link_faults"]:
        err = f" ERROR: {r['error']}" if r["error"] else ""
        lines.append(
            f"| {r['index']} | {r['kind']} | {r['link']} | {r['want']}{err} | {state(r['applied'])} | "
            f"{state(r['undone'])} | {r['undone_by'] or '-'} |"
        )
    return lines


__all__ = ["build_summary", "byzantine_effect", "findings", "loss_by_cell", "markdown", "plot_timeline"]

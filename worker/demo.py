"""`make demo`: a whole Bagel run on this machine, then a report of what it achieved.

    python -m bagel.worker.demo --run examples/digits-2x2.toml --out demo-out [--duration-s 300]
        [--set section.key=value ...]

1. starts a coordinator on the run spec (a subprocess, loopback only) and reads its join string;
   with `--set`, on the spec's text with those keys changed (`protocol/specoverride.py`),
   written to `OUT/run.toml` (`make demo DEMO_SET="diloco.overlap=delayed"`);
2. starts `--workers` workers (default 4) with different `--throttle` values, so one machine
   plays a heterogeneous swarm (the scheduler gives slower workers smaller batches);
3. shows live progress: a table from the coordinator's GetStatus every few seconds;
4. after `--duration-s`, stops the workers gracefully (they finish or abandon the round and
   Leave) and then the coordinator; Ctrl-C stops early the same way (twice: at once);
5. writes to `--out`:
   - `samples.png`: class-conditional samples (one row per digit) of the composed sampler
     over the latest committed state of every cell that trained (workers' local
     checkpoints, else the coordinator's checkpoints; each verified by its state hash);
   - `report.json` and `report.md`: committed rounds per cell, held-out loss per cell at
     the initial weights and at the end, and per worker the bytes it sent next to what
     synchronous data-parallel fp32 training would have sent for the same work (a ring
     all-reduce of fp32 gradients every inner step: 2 (k-1)/k x 4 x params bytes per step
     in a group of k), and per worker its utilisation (training time / wall time) and
     goodput (committed training time / wall time), with its wall time split into the
     simulator's goodput buckets (`worker/goodput.py` reads them off the workers' events),
     and the same for the whole swarm.
Every process started here runs in its own process group and is stopped in a `finally`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_THROTTLES = (1.0, 1.5, 2.0, 3.0)
STATUS_EVERY_S = 3.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bagel.worker.demo", description="Run a local Bagel swarm and report.")
    p.add_argument("--run", type=Path, required=True, help="run spec (TOML)")
    p.add_argument("--out", type=Path, default=Path("demo-out"), help="output directory (default: demo-out)")
    p.add_argument("--duration-s", type=float, default=300.0, help="training time in seconds (default: 300)")
    p.add_argument("--workers", type=int, default=4, help="number of workers (default: 4)")
    p.add_argument(
        "--throttles",
        default=",".join(f"{t:g}" for t in DEFAULT_THROTTLES),
        help="comma-separated --throttle per worker, cycled (default: 1,1.5,2,3)",
    )
    p.add_argument("--sample-steps", type=int, default=32, help="Euler steps of the composed sampler (default: 32)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="change one key of the run spec for this run (repeatable), e.g. diloco.overlap=delayed",
    )
    return p


class _Stop:
    """SIGINT/SIGTERM: first = stop training and report; second = stop at once."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count >= 2:
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        return self.count > 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from bagel.protocol.runspec import SpecError
    from bagel.worker.swarm import CoordinatorProc, Managed, WorkerProc, cleanup, stop_all

    out: Path = args.out
    try:
        throttles = [float(x) for x in args.throttles.split(",") if x.strip()]
        run_path, spec = _run_spec(args.run, args.sets, out)
    except (SpecError, ValueError, OSError) as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    if args.workers < 1 or not throttles or min(throttles) < 1:
        print("demo: --workers must be >= 1 and every throttle >= 1", file=sys.stderr)
        return 2
    for sub in ("coordinator", "workers", "logs"):
        shutil.rmtree(out / sub, ignore_errors=True)  # a fresh run every time
    out.mkdir(parents=True, exist_ok=True)
    if args.sets:
        print(f"run spec: {args.run} with {', '.join(args.sets)} ({run_path})", flush=True)
    stop = _Stop()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    procs: list[Managed] = []
    workers: list[tuple[WorkerProc, float]] = []
    started = time.time()
    try:
        with cleanup(procs):
            coord = CoordinatorProc.make(run_path, out / "coordinator", out / "logs" / "coordinator.log", tick_ms=200)
            procs.append(coord)
            coord.start_and_wait(timeout_s=120)
            print(f"coordinator listening on {coord.endpoint}\njoin string: {coord.join}\n", flush=True)
            for i in range(args.workers):
                t = throttles[i % len(throttles)]
                name = f"worker{i + 1}"
                w = WorkerProc.make(
                    coord.join, out / "workers" / name, out / "logs" / f"{name}.log", name=name, throttle=t
                )
                procs.append(w)
                w.start()
                workers.append((w, t))
                print(f"started {name} (--throttle {t:g}), log: {w.log_path}", flush=True)
            start_losses = _initial_losses(spec)  # while the workers start up
            _watch(
                coord.endpoint,
                coord.tls_fingerprint,
                workers,
                args.duration_s,
                stop,
                out / "coordinator" / "coordinator.key",
            )
            print("\nstopping the workers (they finish or abandon their round and leave)...", flush=True)
            stop_all([w for w, _ in workers], timeout_s=60.0)
            final_status = _status_or_none(
                coord.endpoint, coord.tls_fingerprint, out / "coordinator" / "coordinator.key"
            )
            coord.stop(timeout_s=30)
        print("all processes stopped; evaluating...", flush=True)
        used = {"path": str(args.run), "set": list(args.sets), "overlap": spec.diloco.overlap}
        report = _report(spec, out, workers, start_losses, final_status, time.time() - started, args.sample_steps, used)
        print(_markdown(report))
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: every process was stopped", file=sys.stderr)
        return 130


def _run_spec(path: Path, sets: list[str], out: Path) -> tuple[Path, Any]:
    """The spec file the coordinator serves, and its parsed spec: `path` itself, or with
    `--set` its text with those keys changed, written to `out/run.toml` (a relative
    `model.init_from` is made absolute first, as it is read against the file's folder)."""
    from bagel.protocol.runspec import load_spec, parse_spec
    from bagel.protocol.specoverride import set_keys

    if not sets:
        (out / "run.toml").unlink(missing_ok=True)  # an earlier run's changed spec would mislead
        return path, load_spec(path)
    text = set_keys(path.read_text(), sets)
    init = parse_spec(text).model.init_from
    if init and not Path(init).is_absolute():
        text = set_keys(text, [f"model.init_from={json.dumps(str(path.resolve().parent / init))}"])
    out.mkdir(parents=True, exist_ok=True)
    run_path = out / "run.toml"
    run_path.write_text(text)
    return run_path, load_spec(run_path)


# ---------------------------------------------------------------------------- live view


def _status_or_none(endpoint: str, tls_fingerprint: str, key: Path | None = None) -> Any:
    from bagel.worker.swarm import get_status

    try:
        return get_status(endpoint, tls_fingerprint=tls_fingerprint, key=key)
    except Exception:  # the coordinator may be briefly unresponsive; the view just skips
        return None


def _watch(
    endpoint: str, tls_fingerprint: str, workers: list, duration_s: float, stop: _Stop, key: Path | None = None
) -> None:
    """Print a compact table of cells and workers every few seconds until time is up."""
    from bagel.protocol import bagel_pb2 as pb

    names = {}
    t0 = time.time()
    tty = sys.stdout.isatty()
    last_print = 0.0
    while time.time() - t0 < duration_s and not stop.requested:
        time.sleep(min(STATUS_EVERY_S, max(0.1, duration_s - (time.time() - t0))))
        st = _status_or_none(endpoint, tls_fingerprint, key)
        if st is None:
            continue
        for w in st.workers:
            names[w.worker_id] = w.name or w.worker_id[:8]
        if not tty and time.time() - last_print < 15.0:
            continue
        last_print = time.time()
        lines = [f"--- {time.time() - t0:5.0f}s / {duration_s:.0f}s " + "-" * 50]
        lines.append(f"{'cell':8} {'committed':>9} {'round':>9} {'members':>7} {'last loss':>9} {'samples':>9}")
        for c in st.cells:
            lines.append(
                f"{c.cell_id:8} {c.committed_round:9d} {c.round_state:>9} {len(c.members):7d} "
                f"{c.last_loss:9.4f} {c.samples_committed:9d}"
            )
        lines.append(f"{'worker':10} {'cell':8} {'phase':9} {'samples/s':>9} {'rounds':>6} {'state':>7}")
        for w in sorted(st.workers, key=lambda w: w.name):
            phase = pb.Phase.Name(w.phase).removeprefix("PHASE_").lower()
            lines.append(
                f"{(w.name or w.worker_id[:10]):10} {w.cell_id or '-':8} {phase:9} {w.samples_per_s:9.0f} "
                f"{w.rounds_contributed:6d} {w.state:>7}"
            )
        print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------- evaluation


def _initial_losses(spec: Any) -> dict[str, float]:
    from bagel.models.experts import cell_task

    out = {}
    for cell in spec.cell_ids:
        task = cell_task(spec, cell)
        x, y = task.heldout_data()
        out[cell] = task.eval_loss(task.build_model(), x, y, seed=0)
    return out


def _latest_states(spec: Any, out: Path, workers: list) -> dict[str, tuple[int, Any, str]]:
    """cell -> (round, CellState, source): the newest verified state of every cell."""
    from bagel.worker.diloco import CellState, state_dtype
    from bagel.worker.localstate import LocalStateError, LocalStore

    best: dict[str, tuple[int, Any, str]] = {}
    for w, _ in workers:
        try:
            cp = LocalStore(w.data_dir, spec.run.id, spec.spec_hash).load()
        except LocalStateError:
            continue
        if cp is not None and cp.committed_round > best.get(cp.cell_id, (0,))[0]:
            best[cp.cell_id] = (cp.committed_round, cp.state, f"{w.name} local checkpoint")
    root = out / "coordinator" / "checkpoints"
    for meta_path in sorted(root.rglob("*.json")) if root.exists() else []:
        try:
            meta = json.loads(meta_path.read_text())
            cell, rnd = str(meta["cell_id"]), int(meta["round"])
            if rnd <= best.get(cell, (0,))[0]:
                continue
            data = (meta_path.parent / Path(meta["path"]).name).read_bytes()
            state = CellState.from_safetensors(data, dtype=state_dtype(spec))
            if state.state_hash() != meta["state_hash"]:
                continue
            best[cell] = (rnd, state, "coordinator checkpoint")
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return best


def _ddp_bytes(commit: dict[str, Any], params: int) -> float:
    """fp32 gradient bytes a ring all-reduce sends per worker over the round's inner steps."""
    k = int(commit.get("contributors") or 0)
    if k < 2 or commit.get("catch_up"):
        return 0.0
    return commit["inner_steps"] * 2.0 * (k - 1) / k * 4.0 * params


def _report(
    spec: Any,
    out: Path,
    workers: list,
    start_losses: dict[str, float],
    status: Any,
    wall_s: float,
    sample_steps: int,
    used: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import torch

    from bagel.models.compose import from_cells, sample
    from bagel.models.evaluate import save_grid
    from bagel.models.experts import cell_task

    states = _latest_states(spec, out, workers)
    cells: dict[str, Any] = {}
    models = {}
    params: dict[str, int] = {}
    for cell in spec.cell_ids:
        task = cell_task(spec, cell)
        model = task.build_model()
        params[cell] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        x, y = task.heldout_data()
        entry: dict[str, Any] = {
            "heldout_loss_start": start_losses[cell],
            "heldout_loss_end": None,
            "state_round": 0,
            "state_source": "none (never trained)",
        }
        if status is not None:
            c = next((c for c in status.cells if c.cell_id == cell), None)
            if c is not None:
                entry["committed_rounds"] = int(c.committed_round)
                entry["samples_committed"] = int(c.samples_committed)
        if cell in states:
            rnd, state, source = states[cell]
            state.load_into(model, sampling=True)  # the average of the committed weights, where kept
            entry.update(heldout_loss_end=task.eval_loss(model, x, y, seed=0), state_round=rnd, state_source=source)
            models[cell] = model
        else:
            entry["heldout_loss_end"] = start_losses[cell]
        entry["loss_fell"] = entry["heldout_loss_end"] < entry["heldout_loss_start"]
        cells[cell] = entry
    wrows: dict[str, Any] = {}
    logs = {w.name: w.events() for w, _ in workers}
    accounts, swarm = time_accounts(logs)
    for w, throttle in workers:
        commits = [e for e in logs[w.name] if e.get("event") == "committed"]
        sent = max((e.get("exchange_sent_total", 0) for e in commits), default=0)
        total = max((e.get("bytes_sent_total", 0) for e in commits), default=0)
        ddp = sum(_ddp_bytes(e, params.get(e["cell"], 0)) for e in commits)
        wrows[w.name] = {
            "throttle": throttle,
            "rounds_committed": len(commits),
            "rounds_contributed": sum(1 for e in commits if e.get("samples", 0) > 0),
            "samples": sum(e.get("samples", 0) for e in commits),
            "cells": sorted({e["cell"] for e in commits}),
            "bytes_sent_exchange": sent,
            "bytes_sent_total": total,
            "ddp_fp32_bytes_same_work": int(ddp),
            "reduction_vs_ddp": (ddp / sent) if sent else None,
            "time": accounts[w.name],
        }
    png = out / "samples.png"
    if models:
        composed = from_cells(spec, models)
        nc = spec.model.num_classes
        g = torch.Generator().manual_seed(0)
        rows = nc if nc > 0 else 8
        labels = torch.arange(rows).repeat_interleave(10) if nc > 0 else None
        noise = torch.randn(rows * 10, spec.model.channels, spec.model.image_size, spec.model.image_size, generator=g)
        images = sample(composed, noise, labels, steps=sample_steps)
        save_grid(images, png, nrow=10)
    report = {
        "run_id": spec.run.id,
        "spec": used,
        "wall_s": round(wall_s, 1),
        "cells": cells,
        "workers": wrows,
        "swarm_time": swarm,
        "samples_png": str(png) if models else None,
        "loss_fell_in_every_cell": all(c["loss_fell"] for c in cells.values()),
        "committed_samples": committed_samples(cells, wall_s),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(_markdown(report))
    return report


def committed_samples(cells: dict[str, dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The samples the cells committed (the coordinator's count), in all and per second of
    the run's wall time: the swarm's real throughput. The time split cannot show it: a step
    that shares a CPU with other processes counts as training however slowly it runs."""
    from bagel.protocol.runspec import ROUTER_CELL

    expert = sum(c.get("samples_committed", 0) for k, c in cells.items() if k != ROUTER_CELL)
    router = sum(c.get("samples_committed", 0) for k, c in cells.items() if k == ROUTER_CELL)
    per_s = (expert + router) / wall_s if wall_s > 0 else 0.0
    return {"expert_cells": expert, "router": router, "per_s": round(per_s, 1)}


def time_accounts(logs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per worker and for the swarm: wall time in the goodput buckets, utilisation and goodput
    (JSON-ready), from each worker's `--log-json` events; round fates are settled with what
    every worker logged."""
    from bagel.worker.goodput import SwarmFacts, account, total

    facts = SwarmFacts.of(logs.values())
    per = {name: account(events, facts) for name, events in logs.items()}
    return {name: a.to_json() for name, a in per.items()}, total(per.values()).to_json()


def time_markdown(workers: dict[str, dict[str, Any]], swarm: dict[str, Any]) -> list[str]:
    """The report's utilisation and goodput section: one row per worker and the swarm's, then
    the swarm's wall time by bucket as shares (the simulator's table)."""
    from bagel.protocol.goodput import BUCKET_DEFINITIONS, BUCKETS

    lines = [
        "## Utilisation and goodput",
        "",
        "Utilisation: training time / wall time; goodput: committed training time / wall time "
        "(the simulator's buckets, from each worker's events).",
        "",
        "| worker | wall s | training s | utilisation | goodput | " + " | ".join(BUCKETS) + " |",
        "|---|" + "---:|" * (4 + len(BUCKETS)),
    ]
    rows = [(name, w) for name, w in workers.items()] + [("**swarm**", swarm)]
    for name, t in rows:
        wall = t["wall_s"] or 1.0
        shares = " | ".join(f"{t['buckets_s'][b] / wall:.3f}" for b in BUCKETS)
        lines.append(
            f"| {name} | {t['wall_s']:.0f} | {t['training_s']:.0f} | {t['utilisation']:.3f} | "
            f"{t['goodput']:.3f} | {shares} |"
        )
    lines += ["", "| bucket | share of the swarm's wall time | what it holds |", "|---|---:|---|"]
    wall = swarm["wall_s"] or 1.0
    for b in BUCKETS:
        lines.append(f"| {b} | {swarm['buckets_s'][b] / wall:.3f} | {BUCKET_DEFINITIONS[b]} |")
    return lines


def _fmt_bytes(n: float) -> str:
    from bagel.worker.display import human_bytes

    return human_bytes(n)


def _spec_lines(spec: dict[str, Any] | None) -> list[str]:
    if not spec:
        return []
    changed = f" with {', '.join(f'`{x}`' for x in spec['set'])}" if spec["set"] else ""
    return [f"Run spec: `{spec['path']}`{changed}; overlap of the exchange with compute: `{spec['overlap']}`.", ""]


def _markdown(r: dict[str, Any]) -> str:
    lines = [
        f"# Bagel demo: run `{r['run_id']}`",
        "",
        f"Wall time: {r['wall_s']:.0f} s.",
        "",
        *_spec_lines(r.get("spec")),
        "## Cells",
        "",
        "| cell | committed rounds | held-out loss start | end | state used |",
        "|---|---:|---:|---:|---|",
    ]
    for cell, c in r["cells"].items():
        lines.append(
            f"| {cell} | {c.get('committed_rounds', '-')} | {c['heldout_loss_start']:.4f} | "
            f"{c['heldout_loss_end']:.4f} | round {c['state_round']} ({c['state_source']}) |"
        )
    lines += [
        "",
        "## Workers",
        "",
        "| worker | throttle | cells | rounds (contributed) | samples | bytes sent (exchange) "
        "| DDP fp32, same work | reduction |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, w in r["workers"].items():
        red = f"{w['reduction_vs_ddp']:.0f}x" if w["reduction_vs_ddp"] else "-"
        lines.append(
            f"| {name} | {w['throttle']:g} | {', '.join(w['cells']) or '-'} | "
            f"{w['rounds_committed']} ({w['rounds_contributed']}) | "
            f"{w['samples']} | {_fmt_bytes(w['bytes_sent_exchange'])} | {_fmt_bytes(w['ddp_fp32_bytes_same_work'])} "
            f"| {red} |"
        )
    if r.get("swarm_time"):
        lines += ["", *time_markdown({n: w["time"] for n, w in r["workers"].items()}, r["swarm_time"])]
    if r.get("committed_samples"):
        cs = r["committed_samples"]
        lines += [
            "",
            f"Committed samples: {cs['expert_cells']} in the expert cells, {cs['router']} in the router: "
            f"{cs['per_s']:.0f} per second of wall time (the throughput: on a shared CPU a step counts as "
            "training however slowly it runs).",
        ]
    lines += ["", f"Held-out loss fell in every cell: **{r['loss_fell_in_every_cell']}**."]
    if r.get("samples_png"):
        lines.append(f"Samples of the composed model (one row per class): `{r['samples_png']}`.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

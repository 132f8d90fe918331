"""Decentralized against centralized training of the same grid, at equal sample-steps.

(d) decentralized: real processes on loopback, as `make demo` starts them
    (`bagel.worker.swarm`): a coordinator on the run spec and `--workers` workers with the
    demo's throttles, until the expert cells have committed `--sample-steps` sample-steps
    in all (read from the coordinator's GetStatus), then stopped the demo's way. The newest
    verified state of every cell (workers' local checkpoints, else the coordinator's:
    `worker/demo.py`'s `_latest_states`) is sampled with its sampling weights, the average
    of the committed weights where the spec keeps one (`[ema]`).
(a) centralized cells: the same grid, each cell (the router too) trained alone with plain
    AdamW (`models/train.py`: linear warm-up, cosine decay) on its own data and t-range, for
    exactly the sample-steps that cell committed in (d), at the run's batch
    (`diloco.group_batch`) and inner learning rate unless `--central-lr` says otherwise.
(b) monolith: one DiT of the expert architecture on all training images and all t, for the
    expert cells' committed sample-steps in all.

All three are sampled by the same composed sampler (`models/compose.py`, top-1 routing for
the grids) from the same noise and labels, and scored by one digits-FD and class accuracy
(`models/evaluate.py`: an MLP classifier's hidden features, 200 samples per class = 2,000,
against the held-out real digits), as `bench/experts_vs_monolith.py` scores. Held-out loss
per cell is the cell task's own loss on its held-out data (the monolith on each cell's
data and t-range). Bytes: what the workers sent (exchange, and everything: syncs and
checkpoint uploads too), beside what synchronous fp32 data-parallel training of the same
work would have sent (`worker/demo.py`'s ring all-reduce bound). Wall time: (d) from the
coordinator's start to the last stop; (a) and (b) their training time on this process.

The decomposition: `--set section.key=value` rewrites the run spec (e.g. `--set
ema.decay=0.9`, `--set diloco.inner_steps=10`, `--set diloco.codec=fp32 --set
diloco.error_feedback=false`, `--set data.clusters=1 --set cells.timestep_ranges=1 --set
cells.router=false`), so each factor is switched off by one run.

Not a test. Prints a table, writes `--json FILE` and the sample grids (decentralized.png,
centralized_cells.png, monolith.png) into `--out-dir`.
    .venv/bin/python bench/decentralized_vs_centralized.py --json bench-out/dvc.json
    .venv/bin/python bench/decentralized_vs_centralized.py --quick --json bench-out/dvc-quick.json
`--quick` (150,000 expert sample-steps, the decentralized run stopped after 600 s at the
latest) is sized for a shared 2-core machine; the demo's 10 workers stay (with fewer, some of
the grid's 5 cells get no worker).
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

import torch

from bagel.models import compose, experts, flow, train
from bagel.models import evaluate as ev
from bagel.models.data import derive_seed, load_dataset
from bagel.protocol.runspec import ROUTER_CELL, RunSpec, SpecError, load_spec
from bagel.protocol.specoverride import set_keys
from bagel.worker import demo
from bagel.worker.swarm import CoordinatorProc, Managed, WorkerProc, cleanup, get_status


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="examples/digits-2x2.toml", help="run spec (digits source)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key of the run spec (TOML value), repeatable",
    )
    p.add_argument("--json", default="", help="write the results to this JSON file")
    p.add_argument("--out-dir", default="bench-out/decentralized_vs_centralized", help="run folders and grids")
    p.add_argument("--workers", type=int, default=10, help="workers of the decentralized run (the demo's 10)")
    p.add_argument("--sample-steps", type=int, default=500_000, help="expert sample-steps to commit")
    p.add_argument("--max-wall-s", type=float, default=1800.0, help="stop the decentralized run after this long")
    p.add_argument("--central-lr", type=float, default=0.0, help="AdamW lr of (a) and (b) (0 = diloco.inner_lr)")
    p.add_argument("--central-ema", type=float, default=0.0, help="per-step EMA decay of (a) and (b) (0 = none)")
    p.add_argument("--per-class", type=int, default=200, help="conditional samples per class (2,000 for digits)")
    p.add_argument("--sampler-steps", type=int, default=32, help="Euler steps per sample")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of the central training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-monolith", dest="monolith", action="store_false", help="skip (b) (the decomposition's runs)")
    p.add_argument("--quick", action="store_true", help="150,000 sample-steps, at most 600 s: a shared 2-core box")
    args = p.parse_args(argv)
    if args.quick:  # smaller defaults; values given explicitly on the command line win
        for name, value in (("sample_steps", 150_000), ("max_wall_s", 600.0)):
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    return args


# ---------------------------------------------------------------------------- (d) decentralized


def _committed(status: Any, spec: RunSpec) -> dict[str, int]:
    return {c.cell_id: int(c.samples_committed) for c in status.cells if c.cell_id in spec.cell_ids}


def run_decentralized(args: argparse.Namespace, spec_path: Path, spec: RunSpec, out: Path) -> dict[str, Any]:
    """A coordinator and workers on loopback until the expert cells committed the sample-steps."""
    for sub in ("coordinator", "workers", "logs"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    procs: list[Managed] = []
    workers: list[tuple[WorkerProc, float]] = []
    key = out / "coordinator" / "coordinator.key"
    t0 = time.time()
    committed: dict[str, int] = {}
    with cleanup(procs):
        coord = CoordinatorProc.make(spec_path, out / "coordinator", out / "logs" / "coordinator.log", tick_ms=200)
        procs.append(coord)
        coord.start_and_wait(timeout_s=120)
        for i in range(args.workers):
            t = demo.DEFAULT_THROTTLES[i % len(demo.DEFAULT_THROTTLES)]
            name = f"worker{i + 1}"
            w = WorkerProc.make(coord.join, out / "workers" / name, out / "logs" / f"{name}.log", name=name, throttle=t)
            procs.append(w)
            w.start()
            workers.append((w, t))
        last_print = 0.0
        while time.time() - t0 < args.max_wall_s:
            time.sleep(3.0)
            try:
                committed = _committed(get_status(coord.endpoint, tls_fingerprint=coord.tls_fingerprint, key=key), spec)
            except Exception:  # noqa: BLE001 - a busy coordinator may miss one poll
                continue
            done = sum(v for c, v in committed.items() if c != ROUTER_CELL)
            if time.time() - last_print > 20:
                print(f"  [{time.time() - t0:5.0f}s] committed expert sample-steps {done}: {committed}", flush=True)
                last_print = time.time()
            if done >= args.sample_steps:
                break
        for w, _ in workers:
            if w.alive():
                w.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        for w, _ in workers:
            w.stop(timeout_s=60)
        try:
            committed = _committed(get_status(coord.endpoint, tls_fingerprint=coord.tls_fingerprint, key=key), spec)
        except Exception:  # noqa: BLE001 - keep the last poll's figures
            pass
        coord.stop(timeout_s=30)
    wall = time.time() - t0
    states = demo._latest_states(spec, out, workers)
    sent = total = ddp = 0.0
    params = {c: experts.cell_param_count(spec, c) for c in spec.cell_ids}
    for w, _ in workers:
        commits = w.events("committed")
        sent += max((e.get("exchange_sent_total", 0) for e in commits), default=0)
        total += max((e.get("bytes_sent_total", 0) for e in commits), default=0)
        ddp += sum(demo._ddp_bytes(e, params.get(e["cell"], 0)) for e in commits)
    models: dict[str, torch.nn.Module] = {}
    raw: dict[str, torch.nn.Module] = {}  # the committed weights themselves, where an average was sampled
    rounds: dict[str, int] = {}
    for cell, (rnd, state, _source) in states.items():
        model = experts.cell_task(spec, cell).build_model()
        state.load_into(model, sampling=True)
        models[cell] = model.eval()
        rounds[cell] = rnd
        if state.ema is not None:
            plain = experts.cell_task(spec, cell).build_model()
            state.load_into(plain)
            raw[cell] = plain.eval()
    return {
        "models": models,
        "raw_models": raw,
        "committed_sample_steps": committed,
        "state_rounds": rounds,
        "ema": spec.ema.decay > 0,
        "bytes_sent_exchange": int(sent),
        "bytes_sent_total": int(total),
        "ddp_fp32_bytes_same_work": int(ddp),
        "wall_s": wall,
    }


# ---------------------------------------------------------------------------- (a) and (b)


def train_cells(args: argparse.Namespace, spec: RunSpec, committed: dict[str, int]) -> tuple[dict, float]:
    """(a): every cell alone, plain AdamW, for the sample-steps it committed in the decentralized run."""
    batch = spec.diloco.group_batch
    lr = args.central_lr or spec.diloco.inner_lr
    models: dict[str, torch.nn.Module] = {}
    t0 = time.perf_counter()
    for cell in spec.cell_ids:
        steps = committed.get(cell, 0) // batch
        task = experts.cell_task(spec, cell)
        x, y = task.train_data()
        ema = args.central_ema if cell != ROUTER_CELL else 0.0
        r = train.train(
            task.build_model(),
            task.loss,
            x,
            y,
            steps=steps,
            batch_size=batch,
            lr=lr,
            ema=ema,
            seed=derive_seed(args.seed, cell) % 2**31,
        )
        models[cell] = r.model.eval()
        print(f"  (a) {cell}: {steps} steps of {batch}", flush=True)
    return models, time.perf_counter() - t0


def train_monolith(args: argparse.Namespace, spec: RunSpec, sample_steps: int) -> tuple[torch.nn.Module, float]:
    """(b): the expert architecture on all training images and all t, for the experts' sample-steps."""
    ds = load_dataset(spec)
    nc, c = spec.model.num_classes, spec.cells
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed("init", spec.run.seed, "monolith"))
        mono = experts.build(
            experts.expert_config(spec.model.arch, spec.model.preset, spec.model.image_size, spec.model.channels, nc)
        )

    def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return flow.rf_loss(
            model, x, y, gen, t_mean=c.t_mean, t_std=c.t_std, label_dropout=experts.LABEL_DROPOUT, null_label=nc
        )

    batch = spec.diloco.group_batch
    t0 = time.perf_counter()
    r = train.train(
        mono,
        loss,
        ds.x_train,
        ds.y_train,
        steps=sample_steps // batch,
        batch_size=batch,
        lr=args.central_lr or spec.diloco.inner_lr,
        ema=args.central_ema,
        seed=args.seed,
    )
    return r.model.eval(), time.perf_counter() - t0


# ---------------------------------------------------------------------------- scoring


def score(
    args: argparse.Namespace, spec: RunSpec, cells: dict[str, torch.nn.Module] | None, mono: torch.nn.Module | None
) -> tuple[dict[str, Any], torch.Tensor]:
    """FD, class accuracy and held-out loss per expert cell of a grid (`cells`) or a monolith."""
    ds = load_dataset(spec)
    nc = spec.model.num_classes
    if cells is not None:
        model = compose.from_cells(spec, cells)
    else:
        assert mono is not None
        model = compose.single(mono, null_label=nc)
    labels = torch.arange(nc).repeat_interleave(args.per_class)
    gen = torch.Generator().manual_seed(derive_seed("bench-noise", args.seed) % 2**31)
    noise = torch.randn(len(labels), spec.model.channels, spec.model.image_size, spec.model.image_size, generator=gen)
    samples = compose.sample(model, noise, labels, steps=args.sampler_steps)
    clf = _classifier(spec, args.seed)
    rep = ev.evaluate_samples(samples, labels, clf, ds.x_train, ds.x_heldout)
    # the FD: against the held-out real digits, in the same classifier's features
    _, f_gen = ev.classify(clf, samples.clamp(-1, 1))
    _, f_held = ev.classify(clf, ds.x_heldout)
    fd_heldout = ev.frechet_distance(f_gen.numpy(), f_held.numpy())
    losses: dict[str, float | None] = {}
    for cell in spec.expert_cells:
        task = experts.cell_task(spec, cell)
        xh, yh = task.heldout_data()
        net = mono if cells is None else cells.get(cell)
        losses[cell] = None if net is None else task.eval_loss(net, xh, yh, seed=1)
    return {
        "fd": fd_heldout,
        "digits_fd_vs_train": rep.digits_fd,
        "class_acc": rep.class_acc,
        "nn_ratio": rep.nn_ratio,
        "heldout_loss": losses,
    }, samples


def real_floor(spec: RunSpec, seed: int) -> dict[str, float]:
    """The FD real digits score: the training split against the held-out split (and its reverse's reference)."""
    ds = load_dataset(spec)
    clf = _classifier(spec, seed)
    _, f_train = ev.classify(clf, ds.x_train)
    _, f_held = ev.classify(clf, ds.x_heldout)
    return {"fd_train_vs_heldout": ev.frechet_distance(f_train.numpy(), f_held.numpy()), "train_images": len(f_train)}


_CLASSIFIERS: dict[int, ev.DigitsClassifier] = {}


def _classifier(spec: RunSpec, seed: int) -> ev.DigitsClassifier:
    if seed not in _CLASSIFIERS:
        ds = load_dataset(spec)
        _CLASSIFIERS[seed] = ev.train_classifier(ds.x_train, ds.y_train, epochs=20, seed=seed)
    return _CLASSIFIERS[seed]


def _grid(samples: torch.Tensor, per_class: int, nc: int, path: Path) -> str:
    idx = torch.cat([torch.arange(k * per_class, k * per_class + min(10, per_class)) for k in range(nc)])
    return str(ev.save_grid(samples[idx], path, nrow=min(10, per_class)))


def _fmt_bytes(n: float) -> str:
    from bagel.worker.display import human_bytes

    return human_bytes(n)


def print_table(doc: dict[str, Any]) -> None:
    d, a, b = doc["decentralized"], doc["centralized_cells"], doc["monolith"]
    cells = list(d["heldout_loss"])

    def losses(r: dict[str, Any]) -> str:
        return " ".join(f"{c}={v:.4f}" if v is not None else f"{c}=-" for c, v in r["heldout_loss"].items())

    def f3(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    rows = [
        ("FD (vs held-out)", f3(d["fd"]), f3(a["fd"]), f3(b["fd"])),
        ("digits-FD (vs train)", f3(d["digits_fd_vs_train"]), f3(a["digits_fd_vs_train"]), f3(b["digits_fd_vs_train"])),
        ("class accuracy", f3(d["class_acc"]), f3(a["class_acc"]), f3(b["class_acc"])),
        ("held-out loss per cell", losses(d), losses(a), losses(b)),
        (
            "bytes",
            f"{_fmt_bytes(d['bytes_sent_exchange'])} exchange, {_fmt_bytes(d['bytes_sent_total'])} in all",
            f"0 (DDP fp32, same work: {_fmt_bytes(d['ddp_fp32_bytes_same_work'])})",
            "0",
        ),
        (
            "wall time",
            f"{d['wall_s']:.0f} s",
            f"{a['wall_s']:.0f} s",
            "-" if b["wall_s"] is None else f"{b['wall_s']:.0f} s",
        ),
    ]
    print(f"\nexpert sample-steps: {doc['expert_sample_steps']} ({', '.join(cells)}); spec overrides: {doc['set']}")
    print("| | decentralized | (a) centralized cells | (b) monolith |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if "without_ema" in d:
        r = d["without_ema"]
        print(
            f"decentralized sampled from its committed weights (no average): FD {r['fd']:.3f}, "
            f"class accuracy {r['class_acc']:.3f}"
        )
    print(
        f"FD ratio decentralized / (a): {doc['fd_ratio_vs_cells']:.2f} (target <= 1.1); "
        f"real training digits score {doc['real_floor']['fd_train_vs_heldout']:.3f}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.toml"
    try:
        spec_path.write_text(set_keys(Path(args.spec).read_text(), args.set))
    except SpecError as e:
        raise SystemExit(str(e)) from None
    spec = load_spec(spec_path)
    if spec.data.source != "digits" or spec.model.num_classes != 10:
        raise SystemExit("this benchmark needs the digits source with 10 classes")
    nc = spec.model.num_classes
    print(f"(d) decentralized: {args.workers} workers until {args.sample_steps} expert sample-steps", flush=True)
    d = run_decentralized(args, spec_path, spec, out / "run")
    committed = d.pop("committed_sample_steps")
    expert_steps = sum(v for c, v in committed.items() if c != ROUTER_CELL)
    print(f"  committed: {committed} in {d['wall_s']:.0f} s; scoring...", flush=True)
    d_score, d_samples = score(args, spec, d.pop("models"), None)
    raw_models = d.pop("raw_models")
    if raw_models:  # the same run sampled from its committed weights: the average's share
        r_score, r_samples = score(args, spec, raw_models, None)
        d_score["without_ema"] = {
            **r_score,
            "grid": _grid(r_samples, args.per_class, nc, out / "decentralized-raw.png"),
        }
        print(f"  without the average: FD {r_score['fd']:.3f}", flush=True)
    print("(a) centralized cells", flush=True)
    a_models, a_wall = train_cells(args, spec, committed)
    a_score, a_samples = score(args, spec, a_models, None)
    if args.monolith:
        print("(b) monolith", flush=True)
        mono, b_wall = train_monolith(args, spec, expert_steps)
        b_score, b_samples = score(args, spec, None, mono)
        b_doc = {**b_score, "wall_s": b_wall, "grid": _grid(b_samples, args.per_class, nc, out / "monolith.png")}
    else:
        b_doc = {"fd": None, "digits_fd_vs_train": None, "class_acc": None, "wall_s": None}  # not run
        b_doc["heldout_loss"] = dict.fromkeys(spec.expert_cells)
    doc = {
        "decentralized": {**d, **d_score, "grid": _grid(d_samples, args.per_class, nc, out / "decentralized.png")},
        "centralized_cells": {
            **a_score,
            "wall_s": a_wall,
            "grid": _grid(a_samples, args.per_class, nc, out / "centralized_cells.png"),
        },
        "monolith": b_doc,
        "committed_sample_steps": committed,
        "expert_sample_steps": expert_steps,
        "fd_ratio_vs_cells": d_score["fd"] / a_score["fd"],
        "fd_ratio_vs_monolith": d_score["fd"] / b_doc["fd"] if b_doc["fd"] else None,
        "real_floor": real_floor(spec, args.seed),
        "set": args.set,
        "spec": spec.source,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }
    print_table(doc)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return doc


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)

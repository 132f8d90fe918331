"""Experts vs monolith: a 2 clusters x 2 ranges grid of cells plus a router, against one
monolithic DiT, trained on CPU from the same data with the same total sample-steps.

(a) monolith: one tiny-preset DiT on all training images and all t (logit-normal t);
(b) experts: every expert cell of the run spec (default examples/digits-2x2.toml) trained
    independently on its cluster and its widened t-range, plus the router cell; the budget
    is split over cells in proportion to cluster size x range mass, after
    a share for the router. Each expert trains with a batch of batch / (#expert cells), so it
    takes about as many optimizer steps as the monolith on a quarter of the samples per step.
Both are sampled with the same noise, labels and ODE sampler, and compared on held-out
flow-matching loss per t-bucket, digits-FD, class accuracy of conditional samples and a
nearest-neighbour memorisation check (Decentralized Diffusion Models, McAllister et al.
2025, report experts matching or beating a monolith at equal compute).

The experts are sampled with each routing rule of `compose` (top1, the default and the
rule of the issue; sample; mixture; prior); `--routing` picks the one reported as
"experts", the others land under "experts_by_routing".

Control (`--no-control` skips it): the monolith once more, with all its sample-steps, on a
random 1/K of the training images, as many as one cluster's expert sees. On digits (1,617
training images) the FD is data-limited: halving the data costs the monolith about as much
as splitting it into experts does.

Partition: the spec's; examples/digits-2x2.toml sets data.whole_classes, and
`--pixel-clusters` measures plain PCA k-means, which splits digits 5 and 8 between the
clusters; top-1 routing then sends each of those classes to one cluster (t = 1 carries no
information) and drops the other cluster's modes of it.

Learning rates: each side runs at the best of a small grid measured on this benchmark
(seed 0, whole-class clusters, one run per point): monolith {2, 4, 8}e-3 -> 4e-3 (digits-FD
0.867, 0.693, 0.769); experts {1, 2, 4, 6, 8}e-3 -> 6e-3 (1.478, 1.050, 0.979, 0.957,
1.003). The experts take a quarter of the batch and want a higher rate; one shared rate
would favour whichever side it happens to suit.

Prints a table, writes `--json FILE` and the sample grids as PNG (monolith.png and
experts.png, plus experts-<rule>.png). Not a test. About 450 CPU-seconds with the defaults
(one thread), so well under 15 minutes on 2 cores.
    .venv/bin/python bench/experts_vs_monolith.py --json bench-out/experts_vs_monolith.json
    .venv/bin/python bench/experts_vs_monolith.py --quick      # smoke run, about a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import time
from itertools import pairwise
from pathlib import Path

import torch

from bagel.models import checkpoint, compose, experts, flow, train
from bagel.models import evaluate as ev
from bagel.models.data import derive_seed, load_dataset
from bagel.protocol.runspec import ROUTER_CELL, load_spec, parse_cell

BUCKETS = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
ROUTING_RULES = compose.ROUTING_RULES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="examples/digits-2x2.toml", help="run spec (digits source)")
    p.add_argument("--json", default="", help="write the results to this JSON file")
    p.add_argument("--out-dir", default="bench-out/experts_vs_monolith", help="folder for the PNG sample grids")
    p.add_argument("--steps", type=int, default=3000, help="monolith optimizer steps")
    p.add_argument("--batch", type=int, default=128, help="monolith batch; sample-steps = steps x batch")
    p.add_argument("--router-share", type=float, default=0.1, help="share of the sample-steps for the router")
    p.add_argument("--lr", type=float, default=4e-3, help="AdamW peak learning rate of the monolith and router")
    p.add_argument(
        "--expert-lr", type=float, default=6e-3, help="AdamW peak learning rate of the expert cells (0 = --lr)"
    )
    p.add_argument("--ema", type=float, default=0.995, help="EMA decay of the sampled weights (0 = none)")
    p.add_argument("--expert-ema", type=float, default=-1.0, help="EMA decay of the expert cells (-1 = --ema)")
    p.add_argument("--sampler", choices=["euler", "heun"], default="euler")
    p.add_argument("--sampler-steps", type=int, default=32, help="ODE steps per sample")
    p.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance scale (1 = none)")
    p.add_argument(
        "--routing",
        choices=ROUTING_RULES,
        default="top1",
        help="routing rule of the reported experts figures (top1: Decentralized Diffusion Models)",
    )
    p.add_argument(
        "--no-compare-routing",
        dest="compare_routing",
        action="store_false",
        help="evaluate only --routing, not the other rules as well",
    )
    p.add_argument(
        "--pixel-clusters",
        action="store_true",
        help="cluster on PCA features alone (data.whole_classes = false): k-means then splits some "
        "digit classes between clusters, which top-1 routing handles badly",
    )
    p.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="skip the control: the monolith on a random 1/K of the training images",
    )
    p.add_argument("--save-dir", default="", help="also save every trained model here (safetensors + JSON)")
    p.add_argument("--load-dir", default="", help="skip training: evaluate the models a --save-dir run saved")
    p.add_argument(
        "--per-class", type=int, default=200, help="conditional samples per class (FD noise falls with more)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: these models are too small to gain from more, and on a "
        "busy machine idle OpenMP threads spin and cost ~10x the CPU per step)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 150 steps, 20 samples per class")
    args = p.parse_args(argv)
    if args.quick:  # smaller defaults; values given explicitly on the command line win
        for name, value in (("steps", 150), ("per_class", 20), ("sampler_steps", 16)):
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    return args


def _cell_shares(spec, ds) -> dict[str, float]:
    """Share of the expert budget of each expert cell: cluster size x range mass."""
    sizes = {k: len(ds.manifest.members(k)) for k in range(spec.data.clusters)}
    total = sum(sizes.values()) * spec.cells.timestep_ranges
    shares = {}
    for cell in spec.expert_cells:
        kr = parse_cell(cell)
        assert kr is not None  # an expert cell
        shares[cell] = sizes[kr[0]] / total
    return shares


def _train_monolith(
    args: argparse.Namespace, spec, x: torch.Tensor, y: torch.Tensor, log, name: str = "monolith"
) -> tuple[torch.nn.Module, int]:
    """(a): the expert architecture on all training images (x, y) and all t."""
    nc, c = spec.model.num_classes, spec.cells
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed("init", spec.run.seed, "monolith"))
        mono = experts.build(
            experts.expert_config(spec.model.arch, spec.model.preset, spec.model.image_size, spec.model.channels, nc)
        )

    def mono_loss(model, x, y, gen):
        return flow.rf_loss(
            model, x, y, gen, t_mean=c.t_mean, t_std=c.t_std, label_dropout=experts.LABEL_DROPOUT, null_label=nc
        )

    res = train.train(
        mono,
        mono_loss,
        x,
        y,
        steps=args.steps,
        batch_size=args.batch,
        lr=args.lr,
        ema=args.ema,
        warmup=100,
        seed=args.seed,
        log_every=max(1, args.steps // 5),
        log=lambda m: log(f"  {name} {m}"),
    )
    return res.model, res.sample_steps


def _control_subset(spec, ds) -> torch.Tensor:
    """Indices of a random 1/K of the training images (K = clusters): the control monolith
    sees as many images as one cluster's expert, with all of the monolith's sample-steps."""
    n = len(ds.x_train)
    gen = torch.Generator().manual_seed(derive_seed("control-subset", spec.run.seed) % 2**31)
    return torch.randperm(n, generator=gen)[: round(n / spec.data.clusters)].sort().values


def _train_cells(args: argparse.Namespace, spec, ds, log) -> tuple[dict[str, torch.nn.Module], dict[str, dict]]:
    """(b): every expert cell on its cluster and widened range, then the router."""
    budget = args.steps * args.batch
    shares = _cell_shares(spec, ds)
    expert_budget = budget * (1.0 - args.router_share) if spec.cells.router else budget
    expert_batch = max(1, args.batch // len(spec.expert_cells))
    models: dict[str, torch.nn.Module] = {}
    report: dict[str, dict] = {}
    for cell in spec.expert_cells:
        task = experts.cell_task(spec, cell)
        x, y = task.train_data()
        steps = max(1, round(expert_budget * shares[cell] / expert_batch))
        ema = args.ema if args.expert_ema < 0 else args.expert_ema

        def cell_log(m: str, cell: str = cell) -> None:
            log(f"  {cell} {m}")

        r = train.train(
            task.build_model(),
            task.loss,
            x,
            y,
            steps=steps,
            batch_size=expert_batch,
            lr=args.expert_lr or args.lr,
            ema=ema,
            warmup=100,
            seed=derive_seed(args.seed, cell) % 2**31,
            log_every=max(1, steps // 2),
            log=cell_log,
        )
        models[cell] = r.model
        report[cell] = {
            "train_images": len(x),
            "steps": steps,
            "batch": expert_batch,
            "sample_steps": r.sample_steps,
            "t_range": list(task.train_range),
        }
    if spec.cells.router:
        task = experts.cell_task(spec, ROUTER_CELL)
        x, y = task.train_data()
        steps = max(1, round(budget * args.router_share / args.batch))
        r = train.train(
            task.build_model(),
            task.loss,
            x,
            y,
            steps=steps,
            batch_size=args.batch,
            lr=args.lr,
            seed=args.seed,
            log_every=max(1, steps // 2),
            log=lambda m: log(f"  router {m}"),
        )
        models[ROUTER_CELL] = r.model
        report[ROUTER_CELL] = {"steps": steps, "batch": args.batch, "sample_steps": r.sample_steps}
    return models, report


def _load(load_dir: Path, spec) -> tuple[torch.nn.Module, int, dict[str, torch.nn.Module], dict[str, dict]]:
    mono, meta = checkpoint.load(load_dir / "monolith")
    models, report = {}, {}
    for cell in spec.cell_ids:
        models[cell], m = checkpoint.load(load_dir / cell)
        report[cell] = m["metadata"]
    return mono, int(meta["metadata"]["sample_steps"]), models, report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = load_spec(args.spec)
    if args.pixel_clusters:
        spec = dataclasses.replace(spec, data=dataclasses.replace(spec.data, whole_classes=False))
    if spec.data.source != "digits" or spec.model.num_classes != 10:
        raise SystemExit("this benchmark needs the digits source with 10 classes")
    nc = spec.model.num_classes
    ds = load_dataset(spec)
    out_dir = Path(args.out_dir)
    timings: dict[str, float] = {}
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    t0 = time.perf_counter()
    clf = ev.train_classifier(ds.x_train, ds.y_train, epochs=20, seed=args.seed)
    held_pred, _ = ev.classify(clf, ds.x_heldout)
    clf_acc = float((held_pred == ds.y_heldout).float().mean())
    timings["classifier_s"] = time.perf_counter() - t0
    log(f"digits classifier: held-out accuracy {clf_acc:.3f} ({timings['classifier_s']:.0f}s)")

    if args.load_dir:
        mono_model, mono_steps, trained, cell_report = _load(Path(args.load_dir), spec)
        log(f"loaded the monolith and {len(trained)} cells from {args.load_dir}")
    else:
        t0 = time.perf_counter()
        mono_model, mono_steps = _train_monolith(args, spec, ds.x_train, ds.y_train, log)
        timings["monolith_train_s"] = time.perf_counter() - t0
        log(f"monolith: {mono_steps} sample-steps ({timings['monolith_train_s']:.0f}s)")
        t0 = time.perf_counter()
        trained, cell_report = _train_cells(args, spec, ds, log)
        timings["experts_train_s"] = time.perf_counter() - t0
        if args.save_dir:
            checkpoint.save(Path(args.save_dir) / "monolith", mono_model, {"sample_steps": mono_steps})
            for cell, m in trained.items():
                checkpoint.save(Path(args.save_dir) / cell, m, cell_report[cell])
    expert_steps = sum(int(r["sample_steps"]) for r in cell_report.values())
    log(f"experts + router: {expert_steps} sample-steps ({timings.get('experts_train_s', 0):.0f}s)")
    for cell in spec.expert_cells:  # over all t, so the table shows each expert is good inside its range only
        task = experts.cell_task(spec, cell)
        xh, yh = task.heldout_data()
        by_t = ev.loss_per_bucket(trained[cell], xh, yh, BUCKETS, seed=2)
        cell_report[cell].update(
            heldout_loss=task.eval_loss(trained[cell], xh, yh, seed=1),
            heldout_loss_by_t=dict(zip(_bucket_names(), by_t, strict=True)),
        )
    if ROUTER_CELL in trained:
        task = experts.cell_task(spec, ROUTER_CELL)
        xh, yh = task.heldout_data()
        cell_report[ROUTER_CELL]["heldout_ce"] = task.eval_loss(trained[ROUTER_CELL], xh, yh, seed=1)

    composed = compose.from_cells(spec, trained)
    mono_composed = compose.single(mono_model, null_label=nc)

    # evaluation: identical noise and labels for every model and routing rule.
    t0 = time.perf_counter()
    labels = torch.arange(nc).repeat_interleave(args.per_class)
    noise = torch.randn(
        len(labels),
        spec.model.channels,
        spec.model.image_size,
        spec.model.image_size,
        generator=torch.Generator().manual_seed(derive_seed("bench-noise", args.seed) % 2**31),
    )
    grid_idx = torch.cat(
        [torch.arange(k * args.per_class, k * args.per_class + min(10, args.per_class)) for k in range(nc)]
    )

    def evaluate(model: compose.ComposedModel, grid_name: str) -> dict:
        s0 = time.perf_counter()
        samples = compose.sample(
            model, noise, labels, steps=args.sampler_steps, method=args.sampler, guidance=args.guidance
        )
        sample_s = time.perf_counter() - s0
        usage: dict[str, int] = {}
        for _, chosen in model.trace or []:  # which cells answered, during sampling only
            for k, r in chosen.tolist():
                usage[f"k{k}.r{r}"] = usage.get(f"k{k}.r{r}", 0) + 1
        model.trace = None
        rep = ev.evaluate_samples(samples, labels, clf, ds.x_train, ds.x_heldout)
        buckets = ev.loss_per_bucket(
            lambda x, t, y: model.velocity(x, t, y), ds.x_heldout, ds.y_heldout, BUCKETS, seed=2
        )
        grid = ev.save_grid(samples[grid_idx], out_dir / f"{grid_name}.png", nrow=min(10, args.per_class))
        return {
            **rep.as_dict(),
            "heldout_loss_by_t": dict(zip(_bucket_names(), buckets, strict=True)),
            "grid": str(grid),
            "sample_s": sample_s,
            "routing_counts": dict(sorted(usage.items())),
        }

    results = {"monolith": evaluate(mono_composed, "monolith")}
    control: dict | None = None
    if args.control and not args.load_dir:
        t1 = time.perf_counter()
        sub = _control_subset(spec, ds)
        ctl_model, ctl_steps = _train_monolith(args, spec, ds.x_train[sub], ds.y_train[sub], log, "control")
        timings["control_train_s"] = time.perf_counter() - t1
        control = {
            "train_images": len(sub),
            "sample_steps": ctl_steps,
            **evaluate(compose.single(ctl_model, null_label=nc), "monolith-subset"),
        }
        log(f"control monolith on {len(sub)} of {len(ds.x_train)} images: digits-FD {control['digits_fd']:.3f}")
    by_rule: dict[str, dict] = {}
    for rule in [args.routing] + [r for r in ROUTING_RULES if r != args.routing and args.compare_routing]:
        composed.routing = rule
        composed.generator = torch.Generator().manual_seed(derive_seed("bench-routing", args.seed) % 2**31)
        composed.trace = []
        by_rule[rule] = evaluate(composed, "experts" if rule == args.routing else f"experts-{rule}")
        log(
            f"experts, {rule} routing: digits-FD {by_rule[rule]['digits_fd']:.3f}, "
            f"class accuracy {by_rule[rule]['class_acc']:.3f}"
        )
    results["experts"] = by_rule[args.routing]
    timings["evaluation_s"] = time.perf_counter() - t0 - timings.get("control_train_s", 0.0)

    doc = {
        "monolith": results["monolith"],
        "experts": {**results["experts"], "routing": args.routing, "cells": cell_report},
        "experts_by_routing": {
            rule: {
                "digits_fd": r["digits_fd"],
                "class_acc": r["class_acc"],
                "fd_ratio": r["digits_fd"] / results["monolith"]["digits_fd"],
                "nn_ratio": r["nn_ratio"],
                "grid": r["grid"],
                "heldout_loss_by_t": r["heldout_loss_by_t"],
            }
            for rule, r in by_rule.items()
        },
        "sample_steps": mono_steps,
        "experts_sample_steps": expert_steps,
        "monolith_subset": control,
        "partition": "pca" if not spec.data.whole_classes else "pca, whole classes",
        "sampler": {"method": args.sampler, "steps": args.sampler_steps, "guidance": args.guidance},
        "classifier_heldout_acc": clf_acc,
        "fd_ratio": results["experts"]["digits_fd"] / results["monolith"]["digits_fd"],
        "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "timings_s": timings,
        "wall_s": sum(timings.values()),
        # CPU seconds of this process: on a shared machine, wall time overstates the cost.
        "cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime,
    }
    _print_table(doc)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
        log(f"wrote {args.json}")
    return doc


def _bucket_names() -> list[str]:
    return [f"{a:.1f}-{b:.1f}" for a, b in pairwise(BUCKETS)]


def _print_table(doc: dict) -> None:
    m, e = doc["monolith"], doc["experts"]
    rows = [
        ("digits-FD (lower is better)", m["digits_fd"], e["digits_fd"]),
        ("class accuracy", m["class_acc"], e["class_acc"]),
        ("NN-distance ratio (memorisation < 0.5)", m["nn_ratio"], e["nn_ratio"]),
        ("copy fraction", m["copy_fraction"], e["copy_fraction"]),
    ]
    rows += [
        (f"held-out loss, t in {b}", m["heldout_loss_by_t"][b], e["heldout_loss_by_t"][b]) for b in _bucket_names()
    ]
    print(f"\n{'metric':<42}{'monolith':>12}{'experts':>12}")
    for name, a, b in rows:
        print(f"{name:<42}{a:>12.4f}{b:>12.4f}")
    print(f"{'training sample-steps':<42}{doc['sample_steps']:>12}{doc['experts_sample_steps']:>12}")
    cells = {c: v for c, v in e["cells"].items() if "heldout_loss_by_t" in v}
    print(f"\nper-cell held-out loss on its cluster ({', '.join(_bucket_names())}):")
    for c, v in cells.items():
        lo, hi = v["t_range"]
        print(f"  {c} t in [{lo:.2f}, {hi:.2f}]: " + "  ".join(f"{x:.3f}" for x in v["heldout_loss_by_t"].values()))
    print(f"routing (cell: sampler calls x samples), {e['routing']}: {e['routing_counts']}")
    for rule, r in doc["experts_by_routing"].items():
        print(
            f"  experts with {rule:<8} routing: digits-FD {r['digits_fd']:.4f} ({r['fd_ratio']:.3f}x monolith), "
            f"class accuracy {r['class_acc']:.4f}, grid {r['grid']}"
        )
    if doc["monolith_subset"]:
        c = doc["monolith_subset"]
        print(
            f"control, the monolith on {c['train_images']} random training images (1/K) with the same sample-steps: "
            f"digits-FD {c['digits_fd']:.4f} ({c['digits_fd'] / m['digits_fd']:.3f}x monolith), "
            f"class accuracy {c['class_acc']:.4f}, grid {c['grid']}"
        )
    print(f"partition: {doc['partition']}")
    print(
        f"experts / monolith digits-FD: {doc['fd_ratio']:.3f}   (reference FD, real held-out vs train: "
        f"{m['reference_fd']:.2f})"
    )
    print(
        f"grids: {m['grid']}  {e['grid']}   wall: {doc['wall_s']:.0f}s  cpu: {doc['cpu_s']:.0f}s  timings: "
        + ", ".join(f"{k}={v:.0f}" for k, v in doc["timings_s"].items())
    )


if __name__ == "__main__":
    main()
